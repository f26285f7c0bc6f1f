"""`quantpipe gate`: judge one candidate of an eval report against a declarative policy.

Exit 0 when every rule passes, 1 when any fails, 2 when the gate cannot judge: a missing
metric, a stratum a rule names that the report lacks or that has no texts, a report for
another artifact than the one named, or a report whose scope leaves out every rule.
Never a pass on missing data.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import quantpipe.evals
from quantpipe.formats.report import REPORT, read_report
from quantpipe.manifest import StageError, code_version, read_yaml, sha256_file

OPS = {"<=": lambda v, t: v <= t, "<": lambda v, t: v < t, ">=": lambda v, t: v >= t, ">": lambda v, t: v > t}
COMPARES = ("point", "ci_lower", "ci_upper")
SECTIONS = {"quality": "quality", "generation": "quality", "mc": "quality", "lm_eval": "quality", "memory": "any",
            "latency": "latency"}
DEFAULT_POLICY = Path(quantpipe.evals.__file__).resolve().parent / "gates" / "default.yaml"


@dataclass(frozen=True)
class Rule:
    metric: str
    compare: str
    op: str
    threshold: float

    @property
    def section(self) -> str:
        return SECTIONS[self.metric.split(".", 1)[0]]

    def describe(self) -> str:
        which = "" if self.compare == "point" else f" ({self.compare})"
        return f"{self.metric}{which} {self.op} {self.threshold:g}"


def parse_rules(data, path: str, metric_ok, metric_must: str, compares: tuple[str, ...] = COMPARES) -> list[Rule]:
    """The `rules` of a policy file (gate or canary); `metric_ok` says which metric names it takes."""
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list) or not data["rules"]:
        raise StageError(f"--policy {path}: needs a non-empty `rules` list")
    rules = []
    for i, r in enumerate(data["rules"]):
        where = f"--policy {path}: rules[{i}]"
        keys = ["metric", "compare", "op", "threshold"] if len(compares) > 1 else ["metric", "op", "threshold"]
        if not isinstance(r, dict) or set(r) - set(keys):
            raise StageError(f"{where} takes {', '.join(keys[:-1])} and {keys[-1]}; got {r!r}")
        metric, compare, op, thr = r.get("metric"), r.get("compare", "point"), r.get("op"), r.get("threshold")
        if not isinstance(metric, str) or not metric_ok(metric):
            raise StageError(f"{where}.metric must {metric_must}; got {metric!r}")
        if compare not in compares:
            raise StageError(f"{where}.compare must be one of {', '.join(compares)}; got {compare!r}")
        if op not in OPS:
            raise StageError(f"{where}.op must be one of {' '.join(OPS)}; got {op!r}")
        if not isinstance(thr, (int, float)) or isinstance(thr, bool):
            raise StageError(f"{where}.threshold must be a number; got {thr!r}")
        rules.append(Rule(metric, compare, op, float(thr)))
    return rules


def load_policy(path: str) -> tuple[list[Rule], dict]:
    data = read_yaml(path, "--policy")
    rules = parse_rules(data, path, lambda m: m.split(".", 1)[0] in SECTIONS,
                        f"start with one of {', '.join(SECTIONS)}")
    return rules, {"name": data.get("name", Path(path).stem), "path": str(path), "sha256": sha256_file(path)}


def resolve_keys(obj, path: str) -> list[tuple[tuple[str, ...], object]]:
    """[(keys, value)] for a dotted path; keys may contain dots (strata names do), so each
    level takes the longest key the path continues with; `*` takes every key."""
    if path == "":
        return [((), obj)]
    if not isinstance(obj, dict):
        return []
    if path == "*" or path.startswith("*."):
        return [((k, *ks), v) for k in obj for ks, v in resolve_keys(obj[k], path[2:])]
    for key in sorted(obj, key=len, reverse=True):
        if path == key or path.startswith(key + "."):
            return [((key, *ks), v) for ks, v in resolve_keys(obj[key], path[len(key) + 1:])]
    return []


def resolve(obj, path: str) -> list[tuple[str, object]]:
    """[(concrete dotted path, value)] for a path that may hold `*` (see resolve_keys)."""
    return [(".".join(keys), v) for keys, v in resolve_keys(obj, path)]


def _value(v, compare: str) -> tuple[float | None, str | None]:
    if isinstance(v, dict):
        if compare not in v:
            return None, f"has no {compare}"
        v = v[compare]
    elif compare != "point":
        return None, f"is a plain number, it has no {compare}"
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return None, f"is {v!r}"
    return float(v), None


def judge(report: dict, candidate: dict, rules: list[Rule]) -> list[dict]:
    scope = report.get("scope")
    out = []
    for rule in rules:
        row = {"rule": rule.describe(), "metric": rule.metric, "compare": rule.compare, "op": rule.op,
               "threshold": rule.threshold}
        if rule.section != "any" and scope not in (rule.section, "full"):
            out.append({**row, "result": "skipped", "reason": f"report scope is {scope}"})
            continue
        found = resolve(candidate, rule.metric)
        if not found:
            out.append({**row, "result": "cannot_judge", "reason": "metric not in the report"})
            continue
        for path, v in found:
            r = {**row, "metric": path}
            stratum = _stratum_of(candidate, path)
            if stratum is not None and not stratum.get("texts"):
                out.append({**r, "result": "cannot_judge", "reason": "stratum has no texts"})
                continue
            value, why = _value(v, rule.compare)
            if value is None:
                out.append({**r, "result": "cannot_judge", "reason": f"value {why}"})
            else:
                out.append({**r, "value": value, "result": "pass" if OPS[rule.op](value, rule.threshold) else "fail"})
    return out


EXIT_CODES = {"pass": 0, "fail": 1, "cannot_judge": 2}


def outcome(rows: list[dict], undecided: bool = False) -> str:
    """The verdict of judged rule rows: any fail fails; else any row that cannot be judged
    (or `undecided`: a problem outside the rows) cannot judge; only then pass."""
    results = {r["result"] for r in rows}
    if "fail" in results:
        return "fail"
    return "cannot_judge" if "cannot_judge" in results or undecided else "pass"


def _stratum_of(candidate: dict, path: str) -> dict | None:
    prefix = "quality.strata."
    if not path.startswith(prefix):
        return None
    strata = candidate.get("quality", {}).get("strata", {})
    rest = path[len(prefix):]
    for name in sorted(strata, key=len, reverse=True):
        if rest.startswith(name + "."):
            return strata[name]
    return None


def gate(report_dir: str, policy: str, candidate: str | None = None, artifact: str | None = None,
         out: str | None = None) -> tuple[int, dict]:
    """(exit code, verdict); writes verdict.json (into the report folder unless `out`)."""
    from quantpipe.formats.artifact import artifact_sha256

    rpath = Path(report_dir) / REPORT
    report = read_report(report_dir)
    rules, policy_info = load_policy(policy)
    cands = report.get("candidates") or []
    if candidate is None:
        if len(cands) != 1:
            raise StageError(f"report {report_dir} has {len(cands)} candidates "
                             f"({', '.join(c['name'] for c in cands)}); name one with --candidate")
        cand = cands[0]
    else:
        named = [c for c in cands if c["name"] == candidate]
        if not named:
            raise StageError(f"--candidate {candidate}: not in report {report_dir} "
                             f"(has {', '.join(c['name'] for c in cands)})")
        cand = named[0]
    rows = judge(report, cand, rules)
    problems = []
    if artifact is not None:
        current = artifact_sha256(artifact)
        if current != cand["sha256"]:
            problems.append(f"--artifact {artifact}: sha256 {current[:12]} is not the evaluated candidate's "
                            f"{cand['sha256'][:12]} (the artifact changed after its eval, or it is another one)")
    if all(r["result"] == "skipped" for r in rows):
        problems.append(f"report scope {report.get('scope')} leaves every rule of the policy out")
    verdict = outcome(rows, bool(problems))
    code = EXIT_CODES[verdict]
    doc = {"verdict": verdict, "passed": verdict == "pass", "kind": "gate", "scope": report.get("scope"), "rules": rows,
           "problems": problems, "candidate": {"name": cand["name"], "sha256": cand["sha256"], "path": cand["path"]},
           "report": {"path": str(rpath), "sha256": sha256_file(rpath)}, "policy": policy_info,
           "baseline": report.get("baseline"), "heldout": report.get("heldout"), "code_version": code_version()}
    target = Path(out) if out else Path(report_dir) / "verdict.json"
    write_atomic(target, doc)
    if out is None:  # the report's own page then shows the verdict beside the numbers it judged
        from quantpipe.eval.html import report_html

        write_atomic(Path(report_dir) / "report.html", report_html(report, doc))
    return code, doc


def write_atomic(path: Path, doc: dict | str) -> None:
    """`path` replaced whole: a JSON document, or a text (str) as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if isinstance(doc, str):
                f.write(doc)
            else:
                json.dump(doc, f, indent=1, sort_keys=True)
                f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
