"""The gated search's bookkeeping: each candidate's serving bytes, which quality rules it
met, the winner, the closest miss, and search.json / search.html.

Serving bytes order the candidates: the artifact's weight files plus its KV cache at the
recipe's `eval.kv_tokens` (what a server holding that many tokens needs). The cheapest
candidate that passes every rule of the policy wins; cheaper ones are listed with the
rules they failed, so the report says why the winner won.
"""

from __future__ import annotations

from pathlib import Path

from quantpipe.gate import judge, load_policy, outcome, write_atomic

QUALITY_KEYS = ("ppl_delta_pct", "kl_mean", "top1_agreement")


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f} GiB"


def serving_bytes(memory: dict, kv_tokens: int) -> int:
    return int(memory["weight_file_bytes"] + memory["kv_bytes_per_token"] * kv_tokens)


def failed_rules(rows: list[dict]) -> list[str]:
    """The rules not passed, one line per policy rule: a wildcard rule (every stratum) says
    how many of its metrics failed and the worst of them."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("rule", r["metric"]), []).append(r)
    out = []
    for rule, rs in groups.items():
        bad = [r for r in rs if r["result"] in ("fail", "cannot_judge")]
        if not bad:
            continue
        judged = [r for r in bad if r["result"] == "fail"]
        if len(rs) == 1 and judged:
            r = judged[0]
            out.append(f"{r['metric']} ({r['compare']}) = {r['value']:.4g}, needs {r['op']} {r['threshold']:g}")
        elif judged:
            worst = (max if judged[0]["op"] in ("<=", "<") else min)(judged, key=lambda r: r["value"])
            out.append(f"{rule}: {len(judged)} of {len(rs)} fail, worst {worst['metric']} = {worst['value']:.4g}")
        for r in (r for r in bad if r["result"] == "cannot_judge"):
            out.append(f"{r['metric']}: cannot judge ({r.get('reason', '')})")
    return out


def quality_table(report: dict, policy: str, kv_tokens: int) -> list[dict]:
    """One row per candidate of a quality-scope report, cheapest first, judged on every rule
    the report's scope covers (quality and memory; latency rules wait for the A/B)."""
    rules, _ = load_policy(policy)
    rows = []
    for cand in report["candidates"]:
        judged = [r for r in judge(report, cand, rules) if r["result"] != "skipped"]
        mem = cand["memory"]
        rows.append({
            "name": cand["name"], "path": cand["path"], "sha256": cand["sha256"], "weights": cand["weights"],
            "method": cand["method"], "serving_bytes": serving_bytes(mem, kv_tokens),
            "weight_file_bytes": mem["weight_file_bytes"], "kv_bytes_per_token": mem["kv_bytes_per_token"],
            "weight_bytes_ratio": mem["weight_bytes_ratio"],
            "quality": {k: cand.get("quality", {}).get(k) for k in QUALITY_KEYS},
            "mc_drop_points": (cand.get("mc") or {}).get("accuracy_drop_points"),
            "quality_result": outcome(judged), "failed": failed_rules(judged), "quality_rules": len(judged),
            "verdict": None})
    return sorted(rows, key=lambda r: (r["serving_bytes"], r["name"]))


def final_row(verdict: dict) -> dict:
    """What the whole gate said of a candidate that reached the latency A/B."""
    judged = [r for r in verdict["rules"] if r["result"] != "skipped"]
    return {"verdict": verdict["verdict"], "rules": len(judged),
            "rules_met": sum(r["result"] == "pass" for r in judged), "failed": failed_rules(judged) + verdict["problems"],
            "latency": {r["metric"]: r.get("value") for r in judged if r["metric"].startswith("latency.")}}


def status(row: dict) -> str:
    """pass / fail / cannot_judge / not_reached: the row's standing after the search."""
    if row["verdict"] is not None:
        return row["verdict"]
    return row["quality_result"] if row["quality_result"] != "pass" else "not_reached"


def exit_code(table: list[dict], winner: dict | None) -> int:
    if winner is not None:
        return 0
    return 2 if any(status(r) == "cannot_judge" for r in table) else 1


def closest(table: list[dict]) -> dict | None:
    """The candidate with the fewest failing rules (the cheaper one on a tie)."""
    judged = [r for r in table if status(r) in ("fail", "cannot_judge")]
    return min(judged, key=lambda r: (len(r["failed"]), r["serving_bytes"])) if judged else None


def why(table: list[dict], winner: dict) -> str:
    cheaper = [r for r in table if r["serving_bytes"] < winner["serving_bytes"]
               or (r["serving_bytes"] == winner["serving_bytes"] and r["name"] < winner["name"])]
    if not cheaper:
        return f"{winner['name']} is the cheapest candidate to serve and passed every rule"
    return (f"{winner['name']} is the cheapest candidate that passed every rule; each cheaper one failed a rule: "
            + "; ".join(f"{r['name']} ({r['failed'][0] if r['failed'] else status(r)})" for r in cheaper))


def write_report(out: Path, recipe, table: list[dict], winner: dict | None, uri: str | None, policy: str) -> dict:
    """search.json and search.html in `out`, each replaced whole."""
    from quantpipe.pipeline.html import search_html

    rules, policy_info = load_policy(policy)
    near = closest(table) if winner is None else None
    doc = {"stage": "pipeline", "recipe": recipe.to_dict(), "policy": policy_info,
           "bounds": [{"metric": r.metric, "compare": r.compare, "op": r.op, "threshold": r.threshold}
                      for r in rules if r.metric in ("quality.kl_mean", "quality.ppl_delta_pct")],
           "kv_tokens": recipe.kv_tokens,
           "candidates": [{**r, "status": status(r)} for r in table],
           "winner": winner and winner["name"], "model": uri,
           "why": why(table, winner) if winner else None,
           "closest": near and {"name": near["name"], "failed": near["failed"]},
           "exit_code": exit_code(table, winner)}
    write_atomic(out / "search.json", doc)
    write_atomic(out / "search.html", search_html(doc))
    return doc
