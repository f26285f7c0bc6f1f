"""`quantpipe bench sweep` end to end against a real `quantpipe serve` (small scale)."""

import json

import pytest

from quantpipe.cli import main
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.slow


def test_sweep_against_quantpipe_serve(tmp_path):
    server = ServerProcess("--max-model-len", "512", "--kv-cache-memory", "128MiB", log_path=str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        wl = tmp_path / "w.json"
        wl.write_text(json.dumps({"num_requests": 12, "prompt_tokens": {"dist": "uniform", "low": 16, "high": 64},
                                  "output_tokens": 8, "ignore_eos": True, "arrival": {"process": "poisson", "rate": 1}}))
        rc = main(["bench", "sweep", "--url", server.url, "--workload", str(wl), "--stage-duration", "2",
                   "--baseline-requests", "3", "--growth", "4", "--max-levels", "3", "--min-stage-requests", "6",
                   "--max-stage-requests", "24",
                   "--no-progress", "--quiet", "--output-dir", str(tmp_path), "--name", "real",
                   "--scrape-interval", "0.5", "--timeout", "60"])
        assert rc == 0, server.logs()
    finally:
        server.stop()
    result = json.loads((tmp_path / "real.json").read_text())
    assert [s["name"] for s in result["stages"]][0] == "baseline" and len(result["stages"]) >= 2
    ok = [r for s in result["stages"] for r in s["records"] if not r["error"]]
    assert len(ok) >= 3
    assert all(r["output_tokens"] == 8 and r["output_tokens_source"] == "usage" for r in ok)
    assert result["knee"] is not None and result["capacity"] is not None
    html = (tmp_path / "real.html").read_text()
    assert html.count("data:image/png;base64,") >= 3
    assert (tmp_path / "real.csv").read_text().count("\n") >= len(ok)
    # The scrape found quantpipe's own metrics.
    series = result["server_series"]
    assert any(p.get("kv_cache_blocks_total", 0) > 0 for p in series)
    assert all(p["process_resident_memory_bytes"] > 100 * 2**20 for p in series)  # the model alone is bigger
    assert max(p.get("generation_tokens_total", 0) for p in series) >= 8 * len(ok) * 0.5
