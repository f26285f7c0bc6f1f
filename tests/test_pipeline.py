"""`quantpipe pipeline` (what `make quantize` runs): a recipe's candidates through every
stage, the cheapest that passes the gate published; a rerun reuses what did not change;
a gate that nothing passes publishes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pipeline_recipe import parse_search_page

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
SUITE = ("quality: {max_texts: 16, max_tokens: 96, bootstrap: 200}\n"
         "generation: {prompts: 2, max_tokens: 4}\n"
         "mc: {tasks: [general_knowledge], limit: 8}\n"
         "latency: {repeats: 1, requests: 4, concurrency: 2, max_output_tokens: 8}\n")


RECIPE = """
name: smol
calibrate: {{set: {calib}}}
candidates:
  # Cheapest to serve (INT4 weights, INT8 KV), and far outside the policy's quality bounds.
  - {{scheme: W4A16, group_size: 64, method: rtn, kv_cache: int8}}
  # Static INT8 KV scales: a configuration that needs calibration data without GPTQ or AWQ.
  - {{scheme: W8A16, method: rtn, kv_cache: int8, kv_cache_strategy: channel, calib_samples: 16, calib_seq_len: 128}}
  - {{scheme: W8A16, method: rtn}}
eval: {{suite: suite.yaml}}
gate: {{policy: policy.yaml}}
"""


# The registry is each test's own sqlite store: MLflow's tools (and earlier tests that
# used them) set MLFLOW_TRACKING_URI, which the pipeline honours as MLflow's own tools do.
ENV = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"TOKENIZERS_PARALLELISM": "false"}


def _pipeline(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantpipe", "pipeline", "--recipe", str(cwd / "recipe.yaml"), *args],
                          cwd=cwd, capture_output=True, text=True, env=ENV, timeout=1500)


def test_pipeline_publishes_the_cheapest_passing_candidate_and_reuses_unchanged_steps(tmp_path, sample_set):
    import json

    (tmp_path / "suite.yaml").write_text(SUITE)
    (tmp_path / "recipe.yaml").write_text(RECIPE.format(calib=sample_set))
    # Bounds that both W8 candidates clear by a wide margin on 16 texts (KL ~0.007 and
    # ~0.002, top-1 agreement ~0.96 and ~0.98) and W4 RTN misses by far (KL ~0.6). No
    # latency ratio rules: one repeat of four requests is too noisy to gate on (the A/B
    # still runs and is reported).
    (tmp_path / "policy.yaml").write_text(
        "rules:\n"
        "- {metric: quality.kl_mean, compare: ci_upper, op: '<=', threshold: 0.05}\n"
        "- {metric: quality.ppl_delta_pct, compare: ci_upper, op: '<=', threshold: 2.0}\n"
        "- {metric: quality.top1_agreement, compare: ci_lower, op: '>=', threshold: 0.9}\n"
        "- {metric: memory.weight_bytes_ratio, compare: point, op: '<=', threshold: 0.75}\n"
        "- {metric: latency.error_rate, compare: point, op: '<=', threshold: 0.0}\n")
    first = _pipeline(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    winner = "w8a16-rtn-kv-int8-channel"
    assert f"winner:  {winner}" in first.stdout and "model:   models:/smol/1" in first.stdout, first.stdout
    for step in ("[1/7] calibrate", "[2/7] quantize", "[3/7] kernels", "[4/7] eval quality", "[5/7] select",
                 "[6/7] eval latency", "[6/7] gate", "[7/7] publish"):
        assert step in first.stderr
    assert "skipped on CPU" in first.stderr
    assert f"quantize: {winner} (calibrated: static KV cache scales" in first.stderr
    search = json.loads((tmp_path / "reports" / "smol" / "search.json").read_text())
    assert [c["name"] for c in search["candidates"]] == ["w4a16-g64-rtn-kv-int8", winner, "w8a16-rtn"]  # by serving bytes
    assert [c["status"] for c in search["candidates"]] == ["fail", "pass", "not_reached"]
    assert search["winner"] == winner and search["why"].startswith(f"{winner} is the cheapest candidate that passed")
    page = parse_search_page((tmp_path / "reports" / "smol" / "search.html").read_text())
    for metric, bound in (("quality.kl_mean", "0.05"), ("quality.ppl_delta_pct", "2")):
        assert sorted(page.points[metric]) == sorted(c["name"] for c in search["candidates"]), metric
        assert page.bounds[metric] == [bound], metric
    assert page.rows == 3 and f"winner: {winner}" in page.text
    # Quality for all three in one report; latency only for the one that reached the A/B.
    quality = json.loads((tmp_path / "reports" / "smol" / "quality" / "report.json").read_text())
    assert quality["scope"] == "quality" and len(quality["candidates"]) == 3
    assert not (tmp_path / "reports" / "smol" / "latency-w8a16-rtn").exists()
    full = json.loads((tmp_path / "reports" / "smol" / winner / "report.json").read_text())
    assert full["scope"] == "full" and full["candidates"][0]["latency"]["tpot_p50_ratio"]["repeats"] == 1
    verdict = json.loads((tmp_path / "reports" / "smol" / winner / "verdict.json").read_text())
    assert verdict["verdict"] == "pass" and verdict["candidate"]["name"] == winner
    # The gated report's page carries the verdict (each rule, value, bound, result) and both sides' latency CDFs.
    page = (tmp_path / "reports" / "smol" / winner / "report.html").read_text()
    assert "Verdict: pass (5 of 5 rules met" in page and "latency.error_rate" in page
    assert "TTFT CDF" in page and "baseline (n=4)" in page and "candidate (n=4)" in page

    again = _pipeline(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    for reused in [f"unchanged, reusing artifacts/smol/{c['name']}" for c in search["candidates"]] + [
            "unchanged, reusing reports/smol/quality", f"unchanged, reusing reports/smol/latency-{winner}",
            "already published as models:/smol/1"]:
        assert reused in again.stderr, reused

    # MODEL=models:/NAME/VERSION re-quantizes the registered version's source model: here the
    # same default model, so every step is reused and the same version is found.
    again = _pipeline(tmp_path, "models:/smol/1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "re-quantizing the source model of the registered version" in again.stderr
    assert "already published as models:/smol/1" in again.stderr

    # A policy no candidate can meet: exit 1, the closest candidate and its failed rule
    # printed, no new version.
    strict = tmp_path / "strict.yaml"
    strict.write_text("rules:\n- {metric: quality.kl_mean, compare: ci_upper, op: '<=', threshold: 0.000001}\n")
    failed = _pipeline(tmp_path, "--policy", str(strict))
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "winner:  none; closest" in failed.stdout and "quality.kl_mean (ci_upper)" in failed.stdout
    assert "model:   not published" in failed.stdout
    import mlflow

    db = f"sqlite:///{tmp_path}/.quantpipe/registry.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=db, registry_uri=db)
    assert [str(v.version) for v in client.search_model_versions("name='smol'")] == ["1"]


PROBE = {"scheme": "mixed", "method": "rtn", "sensitivity_samples": 1, "sensitivity_tokens": 16}
RUNGS = [{"scheme": "W4A16", "group_size": 64, "method": "rtn"}, dict(PROBE, bits_budget=5.0),
         dict(PROBE, bits_budget=6.0)]


def quantize_step(folder: Path, calib: str, candidates: list[dict], ray: str | None = None) -> tuple:
    """The pipeline's quantize step in `folder` (artifacts/ is relative to it): (recipe, run,
    artifacts by name, what it printed)."""
    import contextlib
    import io

    from quantpipe.distributed import TaskResources
    from quantpipe.formats.artifact import model_sha256
    from quantpipe.pipeline.recipe import PipelineRecipe
    from quantpipe.pipeline.run import Run, quantize_all
    from quantpipe.runtime.model.loader import resolve_model_path

    recipe = PipelineRecipe.from_dict({"name": "smol", "calibrate": {"set": calib}, "candidates": candidates})
    folder.mkdir()
    here, err = os.getcwd(), io.StringIO()
    os.chdir(folder)
    try:
        run = Run(recipe, None, "policy.yaml", ray=ray, resources=TaskResources())
        run.src = resolve_model_path(None)
        run.src_sha, run.calib = model_sha256(run.src), calib
        with contextlib.redirect_stderr(err):
            artifacts = {name: folder / path for name, path in quantize_all(run, recipe.candidates).items()}
    finally:
        os.chdir(here)
    return recipe, run, artifacts, err.getvalue()


def test_mixed_rungs_that_differ_only_in_budget_measure_sensitivities_once(quantized_rungs):
    """The default recipe's 5- and 6-bit rungs: the second reuses the first's table (the
    stage checks it was measured alike); a rung with another probe measures its own."""
    import json

    _, _, artifacts, printed = quantized_rungs
    _, five, six, other = artifacts.values()
    manifest = {a: json.loads((a / "quantpipe.json").read_text())["mixed_precision"] for a in (five, six, other)}
    assert manifest[five]["reused_from"] is None and manifest[other]["reused_from"] is None
    assert manifest[six]["reused_from"]["artifact"] == five.name
    assert manifest[six]["table"] == manifest[five]["table"] != manifest[other]["table"]
    assert manifest[six]["average_bits"] > manifest[five]["average_bits"]
    assert f"(sensitivities reused from {five.name})" in printed

