"""report.html: one self-contained page from report.json (inline SVG, no scripts)."""

from __future__ import annotations

import html

from quantpipe.calibrate.report import html_table

QUALITY = [("ppl_delta_pct", "ppl delta %", "{:+.2f}"), ("kl_mean", "KL mean", "{:.4f}"),
           ("kl_p99", "KL P99", "{:.3f}"), ("top1_agreement", "top-1 agreement", "{:.2%}"),
           ("top5_miss", "top-5 miss", "{:.2%}")]


def format_ci(v, fmt: str) -> str:
    """A point with its CI ([lower, upper]) or standard error (±), or a plain number; - if missing."""
    if isinstance(v, dict):
        if v.get("point") is None:
            return "-"
        s = fmt.format(v["point"])
        if "ci_lower" in v:
            s += f" [{fmt.format(v['ci_lower'])}, {fmt.format(v['ci_upper'])}]"
        elif "stderr" in v:
            s += f" ± {fmt.format(v['stderr'])}"
        return s
    return "-" if v is None else fmt.format(v)


def _ci_bars(strata: dict, key: str, title: str) -> str:
    """One row per stratum: the CI as a bar, the point as a tick, zero as a line."""
    rows = [(name, s[key]) for name, s in strata.items() if isinstance(s.get(key), dict)]
    if not rows:
        return ""
    lo = min(0.0, *(v["ci_lower"] for _, v in rows))
    hi = max(0.0, *(v["ci_upper"] for _, v in rows)) or 1.0
    label_w, plot_w, row_h = 260, 420, 16
    x = lambda v: label_w + plot_w * (v - lo) / ((hi - lo) or 1.0)  # noqa: E731
    out = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{label_w + plot_w + 90}" '
           f'height="{30 + row_h * len(rows)}"><title>{html.escape(title)}</title>'
           f'<text x="{label_w}" y="12" font-size="11">{html.escape(title)} (95% CI)</text>'
           f'<line x1="{x(0):.1f}" y1="18" x2="{x(0):.1f}" y2="{22 + row_h * len(rows)}" stroke="#999"/>']
    for i, (name, v) in enumerate(rows):
        y = 22 + i * row_h
        out.append(f'<text x="{label_w - 6}" y="{y + 10}" font-size="10" text-anchor="end">{html.escape(name)}</text>'
                   f'<rect x="{x(v["ci_lower"]):.1f}" y="{y + 3}" width="{max(1.0, x(v["ci_upper"]) - x(v["ci_lower"])):.1f}" '
                   f'height="8" fill="#1f77b4" opacity="0.5"/>'
                   f'<rect x="{x(v["point"]) - 1:.1f}" y="{y + 1}" width="2" height="12" fill="#1f77b4"/>'
                   f'<text x="{label_w + plot_w + 6}" y="{y + 10}" font-size="10">{v["point"]:.4g}</text>')
    out.append("</svg>")
    return "".join(out)


def _cdf(curves: dict[str, list[float]], title: str) -> str:
    """Empirical CDFs as step lines (baseline grey, candidate blue), x in seconds."""
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return ""
    hi = max(max(v) for v in curves.values()) or 1.0
    w, h, left = 420, 140, 40
    x = lambda v: left + w * v / hi  # noqa: E731
    y = lambda p: 10 + h * (1 - p)  # noqa: E731
    colors = {"baseline": "#888", "candidate": "#1f77b4"}
    out = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{left + w + 130}" height="{h + 40}">'
           f'<title>{html.escape(title)}</title>'
           f'<line x1="{left}" y1="{y(0)}" x2="{left + w}" y2="{y(0)}" stroke="#999"/>'
           f'<text x="{left}" y="{h + 30}" font-size="10">0</text>'
           f'<text x="{left + w}" y="{h + 30}" font-size="10" text-anchor="end">{hi:.3g} s</text>'
           f'<text x="{left + w / 2}" y="{h + 30}" font-size="11" text-anchor="middle">{html.escape(title)}</text>']
    for i, (side, values) in enumerate(curves.items()):
        vs = sorted(values)
        pts = [f"{x(0):.1f},{y(0):.1f}"]
        for j, v in enumerate(vs):
            pts += [f"{x(v):.1f},{y(j / len(vs)):.1f}", f"{x(v):.1f},{y((j + 1) / len(vs)):.1f}"]
        out.append(f'<polyline fill="none" stroke="{colors.get(side, "#d62728")}" stroke-width="1.5" '
                   f'points="{" ".join(pts)}"/>'
                   f'<text x="{left + w + 8}" y="{20 + 14 * i}" font-size="10" fill="{colors.get(side, "#d62728")}">'
                   f'{html.escape(side)} (n={len(vs)})</text>')
    out.append("</svg>")
    return "".join(out)


def _latency(lat: dict, label: str) -> list[str]:
    """Ratio table, per-run table and TTFT / TPOT CDFs (pooled over repeats) of one load shape."""
    keys = [k for k in lat if k.endswith("_ratio") and lat[k]]
    lrows = [[k, f"{lat[k]['point']:.3f}", f"{lat[k]['ci_lower']:.3f}-{lat[k]['ci_upper']:.3f}"
              if "ci_lower" in lat[k] else "-", f"{lat[k]['min']:.3f}-{lat[k]['max']:.3f}", lat[k]["repeats"]]
             for k in keys]
    runs = [[side, i + 1] + [f"{run[k]:.3f}" if isinstance(run.get(k), float) else run.get(k)
                             for k in ("ttft_p50_s", "tpot_p50_s", "e2e_p99_s", "output_tokens_per_s")]
            for side in ("baseline", "candidate") for i, run in enumerate(lat[f"{side}_runs"])]
    parts = [f"<h3>Latency and memory, candidate / baseline: {html.escape(label)}</h3>"
             + html_table(lrows, ["ratio", "geometric mean", "95% CI", "range over repeats", "repeats"]),
             html_table(runs, ["model", "repeat", "TTFT P50 s", "TPOT P50 s", "e2e P99 s", "output tok/s"])]
    for metric, title in (("ttft", "TTFT CDF"), ("tpot", "TPOT CDF")):
        curves = {side: [v for run in lat[f"{side}_runs"] for v in (run.get("samples") or {}).get(metric, [])]
                  for side in ("baseline", "candidate")}
        parts.append(_cdf(curves, f"{title}, {label}"))
    return parts


def _histogram(hist: dict) -> str:
    counts, edges = hist["counts"], hist["edges"]
    total = sum(counts) or 1
    w, h, bw = 40 * len(counts), 120, 40
    top = max(counts) or 1
    out = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{w + 20}" height="{h + 40}">'
           '<title>per-token KL histogram</title>']
    for i, c in enumerate(counts):
        bh = h * c / top
        label = f"<{edges[i + 1]:.0e}"
        out.append(f'<rect x="{i * bw + 2}" y="{h - bh + 10:.1f}" width="{bw - 4}" height="{bh:.1f}" fill="#ff7f0e">'
                   f'<title>{edges[i]:.1e}-{edges[i + 1]:.1e}: {c} tokens ({c / total:.1%})</title></rect>'
                   f'<text x="{i * bw + 4}" y="{h + 24}" font-size="8">{label}</text>')
    out.append("</svg>")
    return "".join(out)


def verdict_html(verdict: dict) -> str:
    """The gate's verdict on the page: each rule with the value it judged, its bound and result."""
    rows = [[r["metric"], r["compare"], f"{r['value']:.4g}" if "value" in r else r.get("reason", ""),
             f"{r['op']} {r['threshold']:g}", r["result"]] for r in verdict["rules"]]
    color = {"pass": "#2ca02c", "fail": "#d62728"}.get(verdict["verdict"], "#ff7f0e")
    met = sum(r["result"] == "pass" for r in verdict["rules"])
    return (f"<h2 class='verdict' style='color:{color}'>Verdict: {html.escape(verdict['verdict'])} "
            f"({met} of {len(verdict['rules'])} rules met; policy {html.escape(verdict['policy']['name'])}, "
            f"candidate {html.escape(verdict['candidate']['name'])})</h2>"
            + "".join(f"<p>{html.escape(p)}</p>" for p in verdict.get("problems", []))
            + html_table(rows, ["metric", "value compared", "value", "bound", "result"]))


def report_html(report: dict, verdict: dict | None = None) -> str:
    parts = [f"<h1>quantpipe eval: {len(report['candidates'])} candidate(s)</h1>",
             f"<p>scope <b>{report['scope']}</b>; baseline {html.escape(report['baseline']['model'])} "
             f"(sha256 {report['baseline']['sha256'][:12]}); held-out {html.escape(report['heldout']['path'])} "
             f"({report['heldout']['rows']} texts); code {html.escape(report['code_version'])}</p>"]
    if verdict is not None:
        parts.append(verdict_html(verdict))
    head = ["candidate", "weights", "weight bytes", "KV bytes/token"] + [label for _, label, _ in QUALITY] + \
        ["greedy exact match", "MC drop (points)", "TPOT P50 ratio", "tok/s ratio"]
    rows = []
    for c in report["candidates"]:
        q, lat = c.get("quality", {}), c.get("latency", {})
        mem = c["memory"]
        rows.append([c["name"], c["weights"], f"{mem['weight_bytes_ratio']:.1%}",
                     f"{mem['kv_bytes_per_token_ratio']:.1%}" if "kv_bytes_per_token_ratio" in mem else ""]
                    + [format_ci(q.get(k), fmt) for k, _, fmt in QUALITY]
                    + [format_ci(c.get("generation", {}).get("exact_match"), "{:.1%}"),
                       format_ci((c.get("mc") or {}).get("accuracy_drop_points"), "{:+.1f}"),
                       format_ci((lat.get("tpot_p50_ratio") or {}).get("point"), "{:.2f}"),
                       format_ci((lat.get("output_tokens_per_s_ratio") or {}).get("point"), "{:.2f}")])
    parts.append("<h2>Side by side</h2>" + html_table(rows, head))
    for c in report["candidates"]:
        parts.append(f"<h2>{html.escape(c['name'])} ({html.escape(c['weights'])}, {html.escape(c['method'])})</h2>")
        q = c.get("quality")
        if q:
            srows = [[name] + [s.get("texts")] + [format_ci(s.get(k), fmt) for k, _, fmt in QUALITY]
                     for name, s in q["strata"].items()]
            parts.append("<h3>Per stratum</h3>" + html_table(srows, ["stratum", "texts"] + [lb for _, lb, _ in QUALITY]))
            parts.append(_ci_bars(q["strata"], "ppl_delta_pct", "perplexity delta %"))
            parts.append(_ci_bars(q["strata"], "kl_mean", "mean per-token KL"))
            parts.append("<h3>Per-token KL</h3>" + _histogram(q["kl_histogram"]))
        if c.get("mc"):
            mrows = [[t, format_ci(v["acc_baseline"], "{:.3f}"), format_ci(v["acc_candidate"], "{:.3f}"),
                      format_ci(v["accuracy_drop_points"], "{:+.1f}"), format_ci(v.get("recovery"), "{:.3f}"),
                      format_ci(v.get("flips_pct"), "{:.1f}"),
                      "" if "flips" not in v else f"{v['flips']['to_wrong']} / {v['flips']['to_right']}",
                      v["accuracy_drop_points"]["n"]]
                     for t, v in c["mc"]["tasks"].items()]
            m = c["mc"]
            if "flips" in m:  # over every task's items: what the gate's flips rule judges
                mrows.append(["all tasks", "", "", format_ci(m["accuracy_drop_points"], "{:+.1f}"),
                              format_ci(m.get("recovery"), "{:.3f}"), format_ci(m["flips_pct"], "{:.1f}"),
                              f"{m['flips']['to_wrong']} / {m['flips']['to_right']}", m["accuracy_drop_points"]["n"]])
            parts.append("<h3>Multiple choice (BIG-bench through lm-eval, acc)</h3>" + html_table(mrows, [
                "task", "baseline", "candidate", "drop (points)", "recovery", "flips %",
                "right to wrong / wrong to right", "items"]))
        if c.get("lm_eval"):
            lrows = [[t, f"{v['metric']} ({v['filter']})", format_ci(v["baseline"], "{:.3f}"),
                      format_ci(v["candidate"], "{:.3f}"), format_ci(v.get("recovery"), "{:.3f}"),
                      format_ci(v.get("flips_pct"), "{:.1f}"),
                      "" if "flips" not in v else f"{v['flips']['to_wrong']} / {v['flips']['to_right']}", v["n"]]
                     for t, v in c["lm_eval"].items()]
            parts.append("<h3>lm-eval tasks</h3>" + html_table(lrows, [
                "task", "metric", "baseline", "candidate", "recovery", "flips %", "right to wrong / wrong to right",
                "items"]))
        lat = c.get("latency")
        if lat:
            workload = lat.get("workload") or {}
            parts += _latency(lat, f"closed loop, {workload.get('concurrency')} in flight")
            if lat.get("at_rate"):
                parts += _latency(lat["at_rate"], f"open loop, {lat['at_rate']['rate_rps']:g} requests/s")
    style = ("body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}.plot{display:block;margin:1em 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>quantpipe eval</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
