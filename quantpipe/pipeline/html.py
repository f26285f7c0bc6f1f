"""search.html: the gated search on one page (inline SVG, no scripts).

The candidate table (serving bytes, quality with CIs, latency, the rules each failed) and
the frontier: serving bytes against mean KL and against the perplexity delta, one point
per candidate with its 95% CI, the gate's bounds drawn as lines.
"""

from __future__ import annotations

import html
import math

from quantpipe.calibrate.report import html_table
from quantpipe.eval.html import format_ci

COLORS = {"pass": "#2ca02c", "fail": "#d62728", "cannot_judge": "#ff7f0e", "not_reached": "#1f77b4"}


def _scale(kind: str):
    """y transform: KL spans decades (log); perplexity deltas span both signs (symmetric log)."""
    if kind == "log":
        return lambda v: math.log10(max(v, 1e-6))
    return lambda v: math.copysign(math.log10(1 + abs(v)), v)


def _ticks(kind: str, lo: float, hi: float) -> list[float]:
    if kind == "log":
        first, last = (math.floor(math.log10(max(lo, 1e-6))), math.ceil(math.log10(max(hi, 1e-6))))
        return [10.0 ** e for e in range(first, last + 1)]
    marks = [0.0] + [s * 10.0 ** e for e in range(0, 4) for s in (1, -1)]  # 0, +-1, +-10, +-100, +-1000
    return sorted(v for v in marks if lo <= v <= hi)


def frontier(doc: dict, metric: str, title: str, kind: str) -> str:
    """Serving bytes (x) against a quality metric (y, point and 95% CI) for every candidate,
    with the gate's bound on that metric as a dashed line."""
    key = metric.split(".", 1)[1]
    pts = [(c, c["quality"].get(key)) for c in doc["candidates"]]
    pts = [(c, v) for c, v in pts if isinstance(v, dict) and v.get("point") is not None]
    bounds = [b for b in doc["bounds"] if b["metric"] == metric]
    if not pts:
        return ""
    f = _scale(kind)
    xs = [c["serving_bytes"] / 2**30 for c, _ in pts]
    raw = [y for _, v in pts for y in (v.get("ci_lower", v["point"]), v.get("ci_upper", v["point"]))]
    raw += [b["threshold"] for b in bounds] + ([] if kind == "log" else [0.0])
    ys = [f(v) for v in raw]
    x_lo, x_hi = min(xs), max(xs)
    pad = (x_hi - x_lo) * 0.08 or max(x_hi * 0.05, 0.01)
    x_lo, x_hi = x_lo - pad, x_hi + pad
    y_lo, y_hi = min(ys), max(ys)
    y_pad = (y_hi - y_lo) * 0.06 or 1.0
    y_lo, y_hi = y_lo - y_pad, y_hi + y_pad
    left, top, w, h = 70, 24, 520, 260
    x = lambda v: left + w * (v - x_lo) / (x_hi - x_lo)  # noqa: E731
    y = lambda v: top + h * (1 - (f(v) - y_lo) / (y_hi - y_lo))  # noqa: E731
    axis = "log scale" if kind == "log" else "symmetric log scale"
    out = [f'<svg class="frontier" data-metric="{metric}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{left + w + 220}" height="{top + h + 50}"><title>{html.escape(title)}</title>',
           f'<text x="{left}" y="14" font-size="12">{html.escape(title)} ({axis}; bars: 95% CI)</text>',
           f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#999"/>',
           f'<text x="{left + w / 2}" y="{top + h + 36}" font-size="11" text-anchor="middle">serving bytes '
           f'(GiB: weights + KV cache of {doc["kv_tokens"]} tokens)</text>']
    for v in (x_lo + pad, x_hi - pad):
        out.append(f'<text x="{x(v):.1f}" y="{top + h + 16}" font-size="10" text-anchor="middle">{v:.3f}</text>')
    for v in _ticks(kind, min(raw), max(raw)):
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + w}" y2="{y(v):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">{v:g}</text>')
    for b in bounds:
        out.append(f'<line class="bound" data-threshold="{b["threshold"]:g}" data-compare="{b["compare"]}" '
                   f'x1="{left}" y1="{y(b["threshold"]):.1f}" x2="{left + w}" y2="{y(b["threshold"]):.1f}" '
                   f'stroke="#d62728" stroke-dasharray="6,4"/>'
                   f'<text x="{left + w + 6}" y="{y(b["threshold"]) + 4:.1f}" font-size="10" fill="#d62728">'
                   f'gate: {html.escape(b["compare"])} {html.escape(b["op"])} {b["threshold"]:g}</text>')
    seen: dict[int, int] = {}  # labels of points at the same bytes are stacked, not drawn over each other
    for (c, v), xv in zip(pts, xs):
        color = COLORS.get(c["status"], "#555")
        lo, hi = v.get("ci_lower", v["point"]), v.get("ci_upper", v["point"])
        n = seen[round(x(xv) / 40)] = seen.get(round(x(xv) / 40), -1) + 1
        out.append(f'<g class="candidate" data-name="{html.escape(c["name"])}" data-bytes="{c["serving_bytes"]}" '
                   f'data-value="{v["point"]:.6g}" data-status="{c["status"]}">'
                   f'<title>{html.escape(c["name"])}: {v["point"]:.4g} [{lo:.4g}, {hi:.4g}], {c["status"]}</title>'
                   f'<line x1="{x(xv):.1f}" y1="{y(lo):.1f}" x2="{x(xv):.1f}" y2="{y(hi):.1f}" stroke="{color}"/>'
                   f'<circle cx="{x(xv):.1f}" cy="{y(v["point"]):.1f}" r="4" fill="{color}"/>'
                   f'<text x="{x(xv) + 6:.1f}" y="{y(v["point"]) - 6 + 11 * n:.1f}" font-size="10">'
                   f'{html.escape(c["name"])}</text></g>')
    out.append("</svg>")
    return "".join(out)


def search_html(doc: dict) -> str:
    head = ["candidate", "status", "serving bytes", "weight bytes", "KV bytes/token", "ppl delta %", "KL mean",
            "top-1 agreement", "MC drop (points)", "latency", "rules failed"]
    rows = []
    for c in doc["candidates"]:
        q = c["quality"]
        lat = ", ".join(f"{k.removeprefix('latency.')} {v:.3g}" for k, v in (c.get("latency") or {}).items()
                        if v is not None) or ("not measured" if c["status"] != "pass" else "-")
        rows.append([c["name"], c["status"], f"{c['serving_bytes'] / 2**30:.3f} GiB",
                     f"{c['weight_file_bytes'] / 2**20:.1f} MiB", c["kv_bytes_per_token"],
                     format_ci(q.get("ppl_delta_pct"), "{:+.2f}"), format_ci(q.get("kl_mean"), "{:.4f}"),
                     format_ci(q.get("top1_agreement"), "{:.2%}"), format_ci(c.get("mc_drop_points"), "{:+.1f}"), lat,
                     "; ".join(c["failed"]) or "none"])
    if doc["winner"]:
        outcome = (f"<p class='outcome'><b>winner: {html.escape(doc['winner'])}</b> "
                   f"({html.escape(doc['model'] or 'not published')}). {html.escape(doc['why'])}</p>")
    else:
        near = doc.get("closest")
        outcome = ("<p class='outcome'><b>no candidate passed the gate</b>"
                   + (f"; closest: {html.escape(near['name'])}, failing {html.escape('; '.join(near['failed']))}"
                      if near else "") + "</p>")
    recipe = doc["recipe"]
    parts = [f"<h1>quantpipe pipeline: {html.escape(recipe['name'])}</h1>", outcome,
             f"<p>recipe {html.escape(str(recipe.get('path')))}; policy {html.escape(doc['policy']['name'])} "
             f"({html.escape(doc['policy']['path'])}); candidates ordered by serving bytes, the latency A/B run "
             f"on the cheapest that passed every quality rule, then the next.</p>",
             "<h2>Candidates</h2>" + html_table(rows, head),
             "<p>Every candidate's quality per stratum: <a href='quality/report.html'>quality/report.html</a>. "
             + "".join(f"The full report {html.escape(c['name'])} was gated on, latency CDFs included: "
                       f"<a href='{html.escape(c['name'])}/report.html'>{html.escape(c['name'])}/report.html</a>. "
                       for c in doc["candidates"] if c["verdict"] is not None) + "</p>",
             "<h2>Frontier</h2>",
             frontier(doc, "quality.kl_mean", "mean per-token KL against serving bytes", "log"),
             frontier(doc, "quality.ppl_delta_pct", "perplexity delta % against serving bytes", "symlog"),
             "<p>" + " ".join(f'<span style="color:{col}">&#9679; {s}</span>' for s, col in COLORS.items()) + "</p>"]
    style = ("body{font-family:sans-serif;margin:2em;max-width:1300px}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}svg{display:block;margin:1em 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>quantpipe pipeline</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
