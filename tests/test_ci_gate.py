"""The regression gate on eval results (scripts/ci-gate, `quantpipe gate --against`):
the code on main passes it against the committed references, and a change that makes
quantization worse (GPTQ that only rounds) fails it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "evals" / "baselines" / "ci.yaml"


def _pinned_cpu() -> dict:
    """scripts/ci-gate.env: the CPU code paths the references were recorded with."""
    lines = (ROOT / "scripts" / "ci-gate.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def _env(**extra: str) -> dict:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", **_pinned_cpu(), **extra)


def _quantpipe(run, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "quantpipe", *args], cwd=ROOT, env=_env(), cpu_seconds=1500)


def _gate_script(runner, folder: Path) -> dict:
    """scripts/ci-gate as CI runs it, its output in folder/ci-gate."""
    out = folder / "ci-gate"
    proc = runner.run(["bash", str(ROOT / "scripts" / "ci-gate")], cwd=ROOT, env=_env(CI_GATE_OUT=str(out)),
                      cpu_seconds=1500)
    return {"out": out, "run": proc}


def _rounds_only(runner, folder: Path) -> dict:
    """The W4A16 candidate as a change that loses GPTQ's error feedback would make it: same
    scheme, group size and name, its columns only rounded to the grid (what GPTQ with a
    dampening that swamps the Hessian computes). Built by `quantpipe quantize --method rtn`
    with the gate's pinned CPU paths (no hook in the GPTQ code), then evaluated and gated
    as the script does, on the same calibration recipe."""
    calib, art = folder / "calib", folder / "ci-w4a16-gptq"
    done = {"out": folder}
    for step, args in (
            ("calibrate", ("calibrate", "--recipe", str(ROOT / "calib_sets" / "recipes" / "sample.yaml"),
                           "--out", str(calib), "--no-progress")),
            ("quantize", ("quantize", "--scheme", "W4A16", "--method", "rtn", "--group-size", "64", "--out", str(art))),
            ("eval", ("eval", "--candidate", str(art), "--calib", str(calib), "--suite",
                      str(ROOT / "evals" / "suites" / "ci.yaml"), "--quality-only", "--out", str(folder / "report"))),
            ("gate", ("gate", str(folder / "report"), "--against", str(BASELINE)))):
        done[step] = proc = _quantpipe(runner.run, *args)
        if proc.returncode != (1 if step == "gate" else 0):
            break
    return done


# Two chains that tests/idle_jobs.py runs beside the suite, each on its own core when one is free.
IDLE_JOB = {"script": _gate_script, "rounds-only": _rounds_only}


@pytest.fixture(scope="module")
def ci_gate_run(idle_jobs) -> dict:
    """The chains' results: {"script": {"out", "run"}, "rounds-only": {"out", step: process}}."""
    return idle_jobs.result(__name__)


def test_main_passes_the_regression_gate(ci_gate_run):
    out, run = ci_gate_run["script"]["out"], ci_gate_run["script"]["run"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    verdict = json.loads((out / "report" / "regression.json").read_text())
    assert verdict["verdict"] == "pass" and not verdict["problems"]
    judged = {r["candidate"] for r in verdict["rules"]}
    assert judged == {"ci-w8a16-rtn", "ci-w4a16-gptq"}
    assert all(r["result"] == "pass" for r in verdict["rules"])
    # Per-stratum references are judged too, not only the overall numbers.
    assert any(".strata." in r["metric"] for r in verdict["rules"])


def test_gptq_that_only_rounds_fails_the_gate(ci_gate_run):
    # GPTQ's gain over rounding is what the references hold, so the gate must see it go.
    chain = ci_gate_run["rounds-only"]
    bad = chain["out"]
    c, q, e, g = (chain.get(step) for step in ("calibrate", "quantize", "eval", "gate"))
    assert c.returncode == 0, c.stderr[-3000:]
    assert q is not None and q.returncode == 0, q.stderr[-3000:]
    assert json.loads((bad / "ci-w4a16-gptq" / "quantpipe.json").read_text())["method"] == "rtn"
    assert e is not None and e.returncode == 0, e.stderr[-3000:]
    assert g is not None and g.returncode == 1, g.stdout + g.stderr
    verdict = json.loads((bad / "report" / "regression.json").read_text())
    failed = {r["metric"] for r in verdict["rules"] if r["result"] == "fail"}
    assert {"quality.kl_mean", "quality.top1_agreement"} <= failed, failed
    assert all(r["candidate"] == "ci-w4a16-gptq" for r in verdict["rules"])
    # The W8A16 candidate is absent from this report: named, never silently passed.
    assert any("ci-w8a16-rtn" in p for p in verdict["problems"])
