"""Markdown table of an eval report's candidates: the headline of each, one row apiece.

    .venv/bin/python benchmarks/eval_table.py reports/NAME/report.json

Quality figures are point [95% CI] over held-out texts (paired bootstrap); the MC drop is
point +- stderr in accuracy points; latency ratios are candidate / baseline, the median
over repeats with its range.
"""

from __future__ import annotations

import json
import sys


def _ci(m: dict | None, fmt: str) -> str:
    if not m:
        return "-"
    if "ci_lower" in m:
        return f"{m['point']:{fmt}} [{m['ci_lower']:{fmt}}, {m['ci_upper']:{fmt}}]"
    return f"{m['point']:{fmt}}"


def _ratio(m: dict | None) -> str:
    return f"{m['point']:.2f} ({m['min']:.2f}-{m['max']:.2f})" if m else "-"


def rows(report: dict) -> list[str]:
    head = ["candidate", "weights", "method", "linear bytes", "KV bytes/token", "ppl delta %", "KL mean",
            "top-1 agreement", "greedy exact", "MC drop (points)", "TPOT P50 ratio", "tok/s ratio"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in report["candidates"]:
        q, mem, lat = c.get("quality") or {}, c["memory"], c.get("latency") or {}
        mc = (c.get("mc") or {}).get("accuracy_drop_points") or {}
        gen = (c.get("generation") or {}).get("exact_match") or {}
        cells = [c["name"], c["weights"], c["method"], f"{mem['weight_bytes_ratio']:.1%}",
                 f"{mem['kv_bytes_per_token_ratio']:.2f}", _ci(q.get("ppl_delta_pct"), ".2f"),
                 _ci(q.get("kl_mean"), ".4f"), _ci(q.get("top1_agreement"), ".3f"),
                 f"{gen['point']:.2f}" if gen.get("point") is not None else "-",
                 f"{mc['point']:+.1f} +- {mc['stderr']:.1f}" if mc.get("point") is not None else "-",
                 _ratio(lat.get("tpot_p50_ratio")), _ratio(lat.get("output_tokens_per_s_ratio"))]
        out.append("| " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1], encoding="utf-8") as f:
        print("\n".join(rows(json.load(f))))
