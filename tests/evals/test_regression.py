"""`quantpipe gate --against`: reference results with tolerances, on hand-made reports
(the real pipeline run against the committed references is tests/test_ci_gate.py)."""

from __future__ import annotations

import json
import re

import pytest

from quantpipe.manifest import StageError
from quantpipe.regression import against, load_baseline

BASELINE = """\
# kept across --record
name: t
tolerances:
  quality.kl_mean: {worse: higher, rel: 0.10}
  quality.top1_agreement: {worse: lower, abs: 0.005}
  quality.strata.*.kl_mean: {worse: higher, rel: 0.20}
"""


def _candidate(name: str, kl: float, top1: float, code_kl: float) -> dict:
    ci = lambda v: {"point": v, "ci_lower": v * 0.9, "ci_upper": v * 1.1}  # noqa: E731
    return {"name": name, "sha256": "0" * 64, "path": name,
            "quality": {"kl_mean": ci(kl), "top1_agreement": ci(top1),
                        "strata": {"task=code": {"texts": 8, "kl_mean": ci(code_kl)},
                                   "length=0-128": {"texts": 8, "kl_mean": ci(kl)}}}}


def _report(tmp_path, name: str, *cands: dict, heldout: str = "a" * 64):
    d = tmp_path / name
    d.mkdir()
    (d / "report.json").write_text(json.dumps({"stage": "eval", "scope": "quality", "heldout": {"sha256": heldout},
                                               "candidates": list(cands)}))
    return d


def test_record_then_judge(tmp_path):
    base = tmp_path / "ci.yaml"
    base.write_text(BASELINE)
    ref = _report(tmp_path, "ref", _candidate("w4", 0.040, 0.90, 0.050), _candidate("w8", 0.004, 0.97, 0.005))
    code, doc = against(str(ref), str(base), write=True)
    assert code == 0 and doc["verdict"] == "pass"
    refs = json.loads((tmp_path / "ci.references.json").read_text())
    assert refs["candidates"]["w4"]["quality"]["strata"]["task=code"]["kl_mean"] == 0.050
    assert base.read_text() == BASELINE  # the hand-written tolerances are never rewritten
    # 3 rules per candidate and stratum: kl, top1, and both strata's kl.
    assert len(doc["rules"]) == 8

    # Within tolerance (kl +5%): pass. Beyond (+15%) on one stratum only: fail, named.
    ok = _report(tmp_path, "ok", _candidate("w4", 0.042, 0.898, 0.052), _candidate("w8", 0.004, 0.97, 0.005))
    assert against(str(ok), str(base))[0] == 0
    worse = _report(tmp_path, "worse", _candidate("w4", 0.040, 0.90, 0.0625), _candidate("w8", 0.004, 0.97, 0.005))
    code, doc = against(str(worse), str(base))
    assert code == 1
    failed = [(r["candidate"], r["metric"]) for r in doc["rules"] if r["result"] == "fail"]
    assert failed == [("w4", "quality.strata.task=code.kl_mean")]
    assert json.loads((worse / "regression.json").read_text())["verdict"] == "fail"
    # Other held-out texts: the numbers are not comparable, whatever they are.
    other = _report(tmp_path, "other", _candidate("w4", 0.040, 0.90, 0.050), _candidate("w8", 0.004, 0.97, 0.005),
                    heldout="b" * 64)
    code, doc = against(str(other), str(base))
    assert code == 2 and "held-out set" in doc["problems"][0]


def test_missing_candidate_or_metric_never_passes(tmp_path):
    base = tmp_path / "ci.yaml"
    base.write_text(BASELINE)
    against(str(_report(tmp_path, "ref", _candidate("w4", 0.04, 0.9, 0.05), _candidate("w8", 0.004, 0.97, 0.005))),
            str(base), write=True)
    only_w4 = _report(tmp_path, "one", _candidate("w4", 0.04, 0.9, 0.05))
    code, doc = against(str(only_w4), str(base))
    assert code == 2 and any("candidate w8" in p for p in doc["problems"])
    lost = _candidate("w4", 0.04, 0.9, 0.05)
    del lost["quality"]["strata"]["task=code"]
    code, doc = against(str(_report(tmp_path, "lost", lost, _candidate("w8", 0.004, 0.97, 0.005))), str(base))
    assert code == 2
    assert [r["metric"] for r in doc["rules"] if r["result"] == "cannot_judge"] == ["quality.strata.task=code.kl_mean"]


def test_no_references_cannot_judge(tmp_path):
    base = tmp_path / "ci.yaml"
    base.write_text(BASELINE)
    code, doc = against(str(_report(tmp_path, "r", _candidate("w4", 0.04, 0.9, 0.05))), str(base))
    assert code == 2 and "record them with --record" in doc["problems"][0]


@pytest.mark.parametrize("tolerances, message", [
    ("{}", "non-empty `tolerances`"),
    ("{quality.kl_mean: {worse: up, rel: 0.1}}", "worse (higher or lower)"),
    ("{quality.kl_mean: {worse: higher, rel: -1}}", "rel must be a number >= 0"),
    ("{quality.kl_mean: {worse: higher}}", "give rel or abs"),
])
def test_bad_baseline_files_are_named(tmp_path, tolerances, message):
    base = tmp_path / "b.yaml"
    base.write_text(f"tolerances: {tolerances}\n")
    with pytest.raises(StageError, match=re.escape(message)) as e:
        load_baseline(str(base))
    assert str(base) in str(e.value)


def test_cli_refuses_policy_with_against(tmp_path, capsys):
    from quantpipe.cli import main

    base = tmp_path / "ci.yaml"
    base.write_text(BASELINE)
    r = str(_report(tmp_path, "r", _candidate("w4", 0.04, 0.9, 0.05)))
    assert main(["gate", r, "--against", str(base), "--policy", str(base)]) == 2
    assert "takes no --policy" in capsys.readouterr().err
    assert main(["gate", r, "--record"]) == 2
    assert "--record needs --against" in capsys.readouterr().err
    assert main(["gate", r, "--against", str(base), "--record"]) == 0
    assert "PASS  w4: quality.kl_mean (point)" in capsys.readouterr().out


def test_a_tolerance_that_could_never_fail_is_refused(tmp_path):
    base = tmp_path / "ci.yaml"
    base.write_text(BASELINE.replace("quality.top1_agreement: {worse: lower, abs: 0.005}",
                                     "quality.top1_agreement: {worse: lower, abs: 0.95}"))
    ref = _report(tmp_path, "ref", _candidate("w4", 0.04, 0.9, 0.05))
    against(str(ref), str(base), write=True)
    code, doc = against(str(ref), str(base))  # the same values: every rule met, yet not a pass
    assert code == 2 and doc["verdict"] == "cannot_judge"
    assert any("quality.top1_agreement" in p and "could never fail" in p for p in doc["problems"]), doc["problems"]


def test_every_tolerance_of_the_ci_baseline_can_fail():
    """Each rule evals/baselines/ci.yaml makes from its committed references has its limit inside
    the range its metric can take, on the worse side: a regression can cross it."""
    from pathlib import Path

    from quantpipe.regression import BOUNDS, rules_for

    root = Path(__file__).resolve().parents[2]
    baseline = load_baseline(str(root / "evals" / "baselines" / "ci.yaml"))
    refs = baseline["references"]["candidates"]
    assert set(refs) == {"ci-w8a16-rtn", "ci-w4a16-gptq"}
    for name, ref in refs.items():
        rules, unmatched, unfailable = rules_for(baseline, ref)
        assert not unmatched and not unfailable, (name, unmatched, unfailable)
        for rule in rules:
            low, high = BOUNDS.get(rule.metric.rsplit(".", 1)[-1], (float("-inf"), float("inf")))
            assert (low < rule.threshold) if rule.op == ">=" else (rule.threshold < high), (name, rule)
        assert any(r.metric == "generation.exact_match" for r in rules)
