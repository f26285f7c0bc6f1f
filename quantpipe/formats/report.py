"""Eval reports (`report.json`, written by `quantpipe eval`) and gate verdicts
(`verdict.json`, written by `quantpipe gate`): reading them with the checks every reader
needs, so a missing, corrupt or foreign file is one error naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from quantpipe.manifest import StageError

REPORT = "report.json"
VERDICT = "verdict.json"


def _load_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StageError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise StageError(f"{what} {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StageError(f"{what} {path}: not valid JSON ({e})") from None


def read_report(report_dir: str | os.PathLike, what: str = "report") -> dict:
    """report.json of an eval output folder; an error naming `what` when it is missing or not one."""
    path = Path(report_dir) / REPORT
    if not path.is_file():
        raise StageError(f"{what} {report_dir}: no {REPORT}; make one with `quantpipe eval`")
    report = _load_json(path, what)
    if not isinstance(report, dict) or report.get("stage") != "eval" or not isinstance(report.get("candidates"), list):
        raise StageError(f"{what} {path}: not an eval report (no stage: eval with a candidates list)")
    for i, cand in enumerate(report["candidates"]):
        if not isinstance(cand, dict) or not isinstance(cand.get("name"), str) or not isinstance(cand.get("sha256"), str):
            raise StageError(f"{what} {path}: candidates[{i}] has no name and sha256")
    return report


def read_verdict(path: str | os.PathLike, what: str = "--verdict") -> dict:
    """A gate verdict (verdict.json); a regression verdict or any other file is refused by name."""
    path = Path(path)
    doc = _load_json(path, what)
    if isinstance(doc, dict) and doc.get("kind") == "regression":
        raise StageError(f"{what} {path}: a regression verdict (`quantpipe gate --against`), not a gate verdict; "
                         f"judge the report with the policy: `quantpipe gate REPORT_DIR`")
    needs = {"verdict": str, "rules": list, "candidate": dict, "report": dict, "policy": dict}
    bad = [k for k, t in needs.items() if not isinstance(doc, dict) or not isinstance(doc.get(k), t)]
    if not bad:
        bad = [f"{k}.sha256" for k in ("candidate", "report", "policy") if not isinstance(doc[k].get("sha256"), str)]
    if bad:
        raise StageError(f"{what} {path}: not a gate verdict (missing or malformed: {', '.join(bad)}); "
                         f"make one with `quantpipe gate`")
    return doc
