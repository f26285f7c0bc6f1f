"""Compare two results (A = before, B = after): per-metric deltas with bootstrap CIs.

Stages are paired by name (a single-stage run pairs with a single-stage run). For each
latency statistic the difference B - A is bootstrapped by resampling both sides; when the
95% CI excludes zero the change is called better (lower) or worse (higher).
"""

from __future__ import annotations

import numpy as np

from quantpipe.runtime.bench.metrics import BOOT_MAX_N, metric_values
from quantpipe.runtime.bench.results import BenchResult, Stage

COMPARED = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p99")
B = 400


def _stat(x: np.ndarray, which: str, axis=None):
    return x.mean(axis=axis) if which == "mean" else np.percentile(x, float(which[1:]), axis=axis)


def diff_ci(a: np.ndarray, b: np.ndarray, which: str, seed: int = 0, conf: float = 0.95) -> dict:
    rng = np.random.default_rng(seed)
    a = a if len(a) <= BOOT_MAX_N else rng.choice(a, BOOT_MAX_N, replace=False)
    b = b if len(b) <= BOOT_MAX_N else rng.choice(b, BOOT_MAX_N, replace=False)
    da = _stat(a[rng.integers(0, len(a), (B, len(a)))], which, axis=1)
    db = _stat(b[rng.integers(0, len(b), (B, len(b)))], which, axis=1)
    d = db - da
    lo, hi = np.percentile(d, [(1 - conf) / 2 * 100, (1 + conf) / 2 * 100])
    va, vb = float(_stat(a, which)), float(_stat(b, which))
    verdict = "better" if hi < 0 else "worse" if lo > 0 else "no significant change"
    return {"a": va, "b": vb, "delta": vb - va, "lo": float(lo), "hi": float(hi),
            "rel": (vb - va) / va if va else None, "verdict": verdict}


def pair_stages(a: BenchResult, b: BenchResult) -> list[tuple[Stage, Stage]]:
    bn = {s.name: s for s in b.stages}
    pairs = [(s, bn[s.name]) for s in a.stages if s.name in bn]
    if not pairs and len(a.stages) == 1 and len(b.stages) == 1:
        pairs = [(a.stages[0], b.stages[0])]
    return pairs


def compare(a: BenchResult, b: BenchResult) -> list[dict]:
    rows = []
    for sa, sb in pair_stages(a, b):
        for m in COMPARED:
            xa, xb = metric_values(sa.records, m), metric_values(sb.records, m)
            if len(xa) < 2 or len(xb) < 2:
                continue
            for st in STATS:
                rows.append({"stage": sa.name, "metric": f"{m}_{st}", **diff_ci(xa, xb, st)})
        ta, tb = sa.summary.get("request_throughput", 0), sb.summary.get("request_throughput", 0)
        rows.append({"stage": sa.name, "metric": "throughput_req_s", "a": ta, "b": tb, "delta": tb - ta,
                     "lo": None, "hi": None, "rel": (tb - ta) / ta if ta else None,
                     "verdict": "no CI (one number per run)"})
    return rows


def print_comparison(rows: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    if not rows:
        con.print("no comparable stages (stage names differ); nothing to compare")
        return
    t = Table(title="quantpipe bench compare (B - A)")
    for c in ("stage", "metric", "A", "B", "delta", "95% CI", "verdict"):
        t.add_column(c, justify="right")
    for r in rows:
        ms = not r["metric"].startswith("throughput")
        f = (lambda v: f"{v * 1000:.2f}ms") if ms else (lambda v: f"{v:.2f}")
        ci = f"[{f(r['lo'])}, {f(r['hi'])}]" if r["lo"] is not None else "-"
        rel = f" ({r['rel']:+.1%})" if r.get("rel") is not None else ""
        color = {"better": "green", "worse": "red"}.get(r["verdict"], "")
        verdict = f"[{color}]{r['verdict']}[/{color}]" if color else r["verdict"]
        t.add_row(r["stage"], r["metric"], f(r["a"]), f(r["b"]), f(r["delta"]) + rel, ci, verdict)
    con.print(t)
