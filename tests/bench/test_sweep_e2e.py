"""End to end: `quantpipe bench sweep` against a concurrency-limited mock finds the knee,
answers capacity with headroom, and writes JSON, CSV and HTML with embedded plots."""

import csv
import json

import pytest

from quantpipe.cli import main
from quantpipe.runtime.bench.mock_server import spawn_mock

pytestmark = pytest.mark.slow  # ~20-25 s on 2 cores (one sweep shared by the tests)

TTFT_MS, ITL_MS, OUT, LIMIT = 10.0, 5.0, 10, 8
SERVICE_S = (TTFT_MS + (OUT - 1) * ITL_MS) / 1000  # per request with a slot
THEORETICAL = LIMIT / SERVICE_S  # ~145 req/s


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    wl = out / "w.json"
    wl.write_text(json.dumps({"num_requests": 100, "prompt_tokens": 32, "output_tokens": OUT,
                              "arrival": {"process": "poisson", "rate": 1}}))
    with spawn_mock(ttft_ms=TTFT_MS, itl_ms=ITL_MS, concurrency=LIMIT) as url:
        rc = main(["bench", "sweep", "--url", url, "--workload", str(wl), "--stage-duration", "1.5",
                   "--growth", "3", "--soak-duration", "2", "--headroom", "0.35", "--target-peak", "300",
                   "--slo", "e2e_p99=500ms", "--no-progress", "--quiet", "--output-dir", str(out), "--name", "s",
                   "--scrape-interval", "0.2"])
        # a single-level run too, for compare
        rc2 = main(["bench", "run", "--url", url, "--workload", str(wl), "--rate", "20", "--num-requests", "30",
                    "--no-progress", "--quiet", "--output-dir", str(out), "--name", "r"])
    assert rc == 0 and rc2 == 0
    return out


def test_knee_within_10_percent_of_theoretical(sweep):
    d = json.loads((sweep / "s.json").read_text())
    knee = d["knee"]
    assert knee["found"]
    assert abs(knee["throughput"] - THEORETICAL) / THEORETICAL < 0.10, knee
    assert knee["explanation"].startswith("queue growing")
    cap = d["capacity"]
    assert cap["max_rate"] <= THEORETICAL * 1.05
    assert cap["recommended_rate"] == pytest.approx(cap["max_rate"] * 0.65)
    assert cap["recommended_rate"] <= 0.65 * THEORETICAL * 1.05
    assert cap["replicas"] == -(-300 // cap["recommended_rate"])
    assert d["soak"]["verdict"] == "stable"
    assert [s["name"] for s in d["stages"]][0] == "baseline"
    assert any(s["saturated"] for s in d["stages"])


def test_outputs_json_csv_html(sweep):
    d = json.loads((sweep / "s.json").read_text())
    n_records = sum(len(s["records"]) for s in d["stages"])
    rec = d["stages"][1]["records"][0]
    assert {"intended_send", "actual_send", "first_token", "chunk_times", "end", "status"} <= set(rec)
    assert all(r["output_tokens"] == OUT for s in d["stages"] for r in s["records"] if r["status"] == 200)
    assert d["server_series"] and {"num_requests_running", "process_resident_memory_bytes"} <= set(d["server_series"][0])
    with open(sweep / "s.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == n_records and float(rows[0]["ttft"]) > 0
    html = (sweep / "s.html").read_text()
    assert html.count("<img") >= 3 and html.count("src='data:image/png;base64,") >= 3
    assert "knee" in html


def test_compare_cli(sweep, capsys):
    out = sweep / "cmp.json"
    assert main(["bench", "compare", str(sweep / "r.json"), str(sweep / "r.json"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows and all(r["verdict"] in ("no significant change", "no CI (one number per run)") for r in rows)
    assert main(["bench", "compare", str(sweep / "r.json"), str(sweep / "nope.json")]) == 2


def test_sweep_refuses_a_floor_above_the_cap(tmp_path, capsys):
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps({"num_requests": 4, "output_tokens": 4}))
    rc = main(["bench", "sweep", "--url", "http://127.0.0.1:9", "--workload", str(wl), "--min-stage-requests", "30",
               "--max-stage-requests", "24", "--output-dir", str(tmp_path), "--no-progress", "--quiet"])
    assert rc == 2 and "--min-stage-requests 30 is above --max-stage-requests 24" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [wl]  # nothing written
