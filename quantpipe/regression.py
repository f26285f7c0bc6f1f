"""Regression gate: a report's candidates against committed reference results.

A baseline (evals/baselines/NAME.yaml, written by hand) says per metric how much worse
a new run may be than the reference:

    tolerances:
      quality.kl_mean: {worse: higher, rel: 0.10}        # at most 10% above the reference
      quality.top1_agreement: {worse: lower, abs: 0.005}  # at most 0.5 points below

and its references (NAME.references.json beside it, written by `--record`) hold, per
candidate name, the values a fixed pipeline run produced:

    {"candidates": {"ci-w4a16-gptq": {"quality": {"kl_mean": 0.0431, "strata": {...}}}}}

`quantpipe gate REPORT --against FILE` turns each (tolerance, reference value) into a rule
of the policy gate (`reference + max(abs, rel x |reference|)`) and judges every candidate
the file names; a candidate or metric the report lacks cannot be judged, which never
passes. `--record` writes the report's values as the new references: the step a change that
moves quantization on purpose takes, reviewed in its diff.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

from quantpipe.formats.report import REPORT, read_report
from quantpipe.gate import EXIT_CODES, Rule, judge, outcome, resolve, resolve_keys, write_atomic
from quantpipe.manifest import StageError, code_version, read_yaml, sha256_file

WORSE = {"higher": "<=", "lower": ">="}


def load_baseline(path: str) -> dict:
    data = read_yaml(path, "--against")
    if not isinstance(data, dict) or not isinstance(data.get("tolerances"), dict) or not data["tolerances"]:
        raise StageError(f"--against {path}: needs a non-empty `tolerances` mapping")
    for metric, tol in data["tolerances"].items():
        where = f"--against {path}: tolerances[{metric!r}]"
        if not isinstance(tol, dict) or set(tol) - {"worse", "rel", "abs"} or tol.get("worse") not in WORSE:
            raise StageError(f"{where} takes worse (higher or lower), rel and abs; got {tol!r}")
        for k in ("rel", "abs"):
            v = tol.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise StageError(f"{where}.{k} must be a number >= 0; got {v!r}")
        if not tol.get("rel") and not tol.get("abs"):
            raise StageError(f"{where}: give rel or abs (a zero tolerance fails on any numerical change)")
    data["references_path"] = str(Path(path).with_suffix(".references.json"))
    try:
        data["references"] = json.loads(Path(data["references_path"]).read_text())
    except FileNotFoundError:
        data["references"] = {}
    except (OSError, ValueError) as e:
        raise StageError(f"--against {path}: cannot read {data['references_path']}: {e}") from None
    return data


# The values a metric can take, where it has bounds: a tolerance whose limit lies past the
# bound on the worse side could never fail, and is refused rather than trusted.
BOUNDS = {"exact_match": (0.0, 1.0), "top1_agreement": (0.0, 1.0), "accuracy": (0.0, 1.0),
          "accuracy_drop_points": (-100.0, 100.0), "flips_pct": (0.0, 100.0), "error_rate": (0.0, 1.0)}


def rules_for(baseline: dict, reference: dict) -> tuple[list[Rule], list[str], list[str]]:
    """(rules, tolerance patterns that match nothing in the reference, rules that can never fail)."""
    rules, unmatched, unfailable = [], [], []
    for pattern, tol in baseline["tolerances"].items():
        found = [(p, v) for p, v in resolve(reference, pattern) if isinstance(v, (int, float)) and math.isfinite(v)]
        if not found:
            unmatched.append(pattern)
        for path, ref in found:
            slack = max(float(tol.get("abs", 0.0)), float(tol.get("rel", 0.0)) * abs(ref))
            limit = ref + slack if tol["worse"] == "higher" else ref - slack
            rules.append(Rule(path, "point", WORSE[tol["worse"]], limit))
            low, high = BOUNDS.get(path.rsplit(".", 1)[-1], (-math.inf, math.inf))
            if (tol["worse"] == "lower" and limit <= low) or (tol["worse"] == "higher" and limit >= high):
                bound = low if tol["worse"] == "lower" else high
                unfailable.append(f"tolerance {pattern} on {path}: the limit {limit:.4g} (reference {ref:.4g}) is past "
                                  f"the metric's bound {bound:g}, so the rule could never fail; narrow it")
    return rules, unmatched, unfailable


def reference_of(candidate: dict, patterns) -> dict:
    """The point values of `candidate` that the tolerance patterns select, nested as in the report."""
    out: dict = {}
    for pattern in patterns:
        for keys, v in resolve_keys(candidate, pattern):
            value = v.get("point") if isinstance(v, dict) else v
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            node = out
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = float(value)
    return out


def record(baseline: dict, report: dict, report_sha: str) -> dict:
    """New references from every candidate of `report`, written beside the baseline file."""
    refs = {c["name"]: reference_of(c, baseline["tolerances"]) for c in report.get("candidates", [])}
    if not refs:
        raise StageError("--record: the report has no candidates")
    doc = {"recorded": {"report_sha256": report_sha, "code_version": code_version(),
                        "date": datetime.date.today().isoformat(), "heldout": report.get("heldout"),
                        "suite": report.get("suite_path")},
           "candidates": refs}
    write_atomic(Path(baseline["references_path"]), doc)
    return doc


def against(report_dir: str, baseline_path: str, out: str | None = None, write: bool = False) -> tuple[int, dict]:
    """(exit code, verdict) of every candidate the baseline has references for."""
    rpath = Path(report_dir) / REPORT
    report = read_report(report_dir)
    baseline = load_baseline(baseline_path)
    if write:
        record(baseline, report, sha256_file(rpath))
        baseline = load_baseline(baseline_path)
    refs = baseline["references"].get("candidates") or {}
    problems, rows = [], []
    if not refs:
        problems.append(f"--against {baseline_path}: no references in {baseline['references_path']} "
                        f"(record them with --record)")
    recorded = baseline["references"].get("recorded") or {}
    want, got = (recorded.get("heldout") or {}).get("sha256"), (report.get("heldout") or {}).get("sha256")
    if want and want != got:  # other texts give other numbers: nothing to compare
        problems.append(f"the report's held-out set (sha256 {str(got)[:12]}) is not the one the references were "
                        f"recorded on ({want[:12]}); if the calibration changed on purpose, record new references")
    by_name = {c["name"]: c for c in report.get("candidates", [])}
    for name, ref in sorted(refs.items()):
        if name not in by_name:
            problems.append(f"candidate {name}: in the baseline, not in the report (has {', '.join(by_name)})")
            continue
        rules, unmatched, unfailable = rules_for(baseline, ref)
        rows += [{**r, "candidate": name} for r in judge(report, by_name[name], rules)]
        problems += [f"candidate {name}: tolerance {p} matches no reference value" for p in unmatched]
        problems += [f"candidate {name}: {p}" for p in unfailable]
    verdict = outcome(rows, bool(problems) or not rows)
    code = EXIT_CODES[verdict]
    doc = {"verdict": verdict, "passed": verdict == "pass", "kind": "regression", "rules": rows,
           "problems": problems, "baseline": {"path": baseline_path, "sha256": sha256_file(baseline_path),
                                              "recorded": baseline["references"].get("recorded")},
           "report": {"path": str(rpath), "sha256": sha256_file(rpath)}, "code_version": code_version()}
    write_atomic(Path(out) if out else Path(report_dir) / "regression.json", doc)
    return code, doc
