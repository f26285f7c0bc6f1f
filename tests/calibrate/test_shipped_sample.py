"""The shipped sample log: `make calibrate` end to end, and topic clusters that find its task types."""

from __future__ import annotations

import gzip
import json
import os
import subprocess

import pytest

from quantpipe.calibrate import CalibConfig, calibrate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = os.path.join(ROOT, "calib_sets", "sample", "requests.jsonl.gz")

pytestmark = pytest.mark.skipif(not os.path.exists(SAMPLE), reason="the shipped sample log is not built")


def test_make_calibrate_writes_the_set_and_its_report(tmp_path):
    out = tmp_path / "sample-set"
    subprocess.run(["make", "-s", "calibrate", f"OUT={out}"], cwd=ROOT, check=True, capture_output=True, text=True)
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["calib"] == 512 and m["counts"]["heldout"] == 256
    tasks = {s["name"].split("|")[0] for s in m["strata"]}
    assert len(tasks) >= 6  # every task type of the sample is a stratum
    assert m["inputs"][0]["sha256"] and m["outputs"]["calib.jsonl"]["sha256"]
    page = (out / "coverage.html").read_text()
    assert 'id="strata-shares"' in page and 'id="length-histogram"' in page
    assert page.count('class="bar"') >= 3 * len(m["strata"])


def test_clusters_recover_the_task_types(tmp_path):
    from sklearn.metrics import adjusted_rand_score

    task_of = {}
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            task_of[rec["id"]] = rec["metadata"].get("task")
    # Labels removed: the strata come from the texts alone.
    result = calibrate(CalibConfig(logs=[SAMPLE], strata=["cluster"], size=512, heldout_size=256, min_per_stratum=4,
                                   cluster_k=[4, 12], out=str(tmp_path / "clusters")))
    rows = result.rows("calib") + result.rows("heldout")
    truth = [task_of[r["source_id"]] for r in rows]
    found = [r["strata"]["cluster"] for r in rows]
    ari = adjusted_rand_score(truth, found)
    assert ari >= 0.7, (ari, result.manifest["clusters"])
