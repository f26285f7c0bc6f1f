"""`quantpipe pipeline` (what `make quantize` runs): every stage in order, ending in a
verdict and a registry entry; a rerun reuses what did not change; a failing gate
publishes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
SUITE = ("quality: {max_texts: 16, max_tokens: 96, bootstrap: 200}\n"
         "generation: {prompts: 2, max_tokens: 4}\n"
         "mc: {tasks: [general_knowledge], limit: 8}\n"
         "latency: {repeats: 1, requests: 4, concurrency: 2, max_output_tokens: 8}\n")


def _pipeline(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantpipe", "pipeline", "--scheme", "W8A16", "--method", "rtn",
                           "--suite", str(cwd / "suite.yaml"), *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), timeout=1500)


def test_pipeline_publishes_what_passes_and_reuses_unchanged_stages(tmp_path, sample_set):
    import yaml

    from quantpipe.gate import DEFAULT_POLICY

    (tmp_path / "suite.yaml").write_text(SUITE)
    # The default policy without its latency rules: one repeat of four requests measures
    # latency ratios too noisily to gate on (the latency A/B still runs and is reported).
    policy = yaml.safe_load(DEFAULT_POLICY.read_text())
    policy["rules"] = [r for r in policy["rules"] if not r["metric"].startswith("latency.")]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    first = _pipeline(tmp_path, "--calib", sample_set, "--name", "smol-w8", "--policy", str(tmp_path / "policy.yaml"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "reports" / "smol-w8" / "report.json").read_text().count('"tpot_p50_ratio"') == 1
    assert "verdict: pass" in first.stdout and "model:   models:/smol-w8/1" in first.stdout, first.stdout
    for stage in ("[1/6] calibrate", "[2/6] quantize", "[3/6] kernels", "[4/6] eval", "[5/6] gate", "[6/6] publish"):
        assert stage in first.stderr
    assert "skipped on CPU" in first.stderr
    assert (tmp_path / "reports" / "smol-w8" / "verdict.json").exists()

    again = _pipeline(tmp_path, "--calib", sample_set, "--name", "smol-w8", "--policy", str(tmp_path / "policy.yaml"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "unchanged, reusing artifacts/smol-w8" in again.stderr and "unchanged, reusing reports/smol-w8" in again.stderr
    assert "already published as models:/smol-w8/1" in again.stderr

    # A policy this artifact cannot meet: exit 1, the failed rule printed, no new version.
    strict = tmp_path / "strict.yaml"
    strict.write_text("rules:\n- {metric: quality.kl_mean, compare: ci_upper, op: '<=', threshold: 0.000001}\n")
    failed = _pipeline(tmp_path, "--calib", sample_set, "--name", "smol-w8", "--policy", str(strict))
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "FAIL: quality.kl_mean (ci_upper)" in failed.stderr and "model:   not published" in failed.stdout
    import mlflow

    db = f"sqlite:///{tmp_path}/.quantpipe/registry.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=db, registry_uri=db)
    assert [str(v.version) for v in client.search_model_versions("name='smol-w8'")] == ["1"]
