"""coverage.html: does the sample look like the traffic? One self-contained page, inline SVG.

Three pictures and two tables, all from the manifest: per-stratum share in the cleaned
log against the calibration and held-out sets (bars), token-length histograms of log and
sample, and the counts of what was dropped and which PII was scrubbed.
"""

from __future__ import annotations

import html

LOG, CALIB, HELDOUT = "#8a8a8a", "#1f77b4", "#ff7f0e"


def _bars(rows: list[tuple[str, list[float]]], series: list[tuple[str, str]], title: str, svg_id: str,
          fmt=lambda v: f"{v:.1%}") -> str:
    """Horizontal grouped bars: one group per row, one bar per series (values in [0, 1])."""
    bar_h, gap, label_w, plot_w = 10, 8, 330, 420
    group_h = bar_h * len(series) + gap
    height = 40 + group_h * len(rows) + 20
    top = max((max(v) for _, v in rows), default=1.0) or 1.0
    out = [f'<svg id="{svg_id}" class="plot" xmlns="http://www.w3.org/2000/svg" width="{label_w + plot_w + 80}" '
           f'height="{height}" role="img"><title>{html.escape(title)}</title>']
    x = label_w
    for i, (name, color) in enumerate(series):
        out.append(f'<rect x="{x}" y="8" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="17" font-size="11">{html.escape(name)}</text>')
        x += 14 + 8 * len(name) + 16
    for r, (label, values) in enumerate(rows):
        y0 = 30 + r * group_h
        out.append(f'<text x="{label_w - 6}" y="{y0 + group_h / 2}" font-size="11" text-anchor="end">'
                   f'{html.escape(label[:60])}</text>')
        for k, ((name, color), v) in enumerate(zip(series, values)):
            w = plot_w * v / top
            y = y0 + k * bar_h
            out.append(f'<rect class="bar" x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 1}" '
                       f'fill="{color}"><title>{html.escape(label)} {name}: {fmt(v)}</title></rect>'
                       f'<text x="{label_w + w + 3:.1f}" y="{y + bar_h - 2}" font-size="9">{fmt(v)}</text>')
    out.append("</svg>")
    return "".join(out)


def html_table(rows: list[list], head: list[str]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def coverage_html(m: dict) -> str:
    strata_rows = [(s["name"], [s["log_share"], s["calib_share"], s["heldout_share"]]) for s in m["strata"]]
    series = [("log", LOG), ("calibration", CALIB), ("held-out", HELDOUT)]
    hist = m["length_histogram"]
    bins = hist["bins"]

    def shares(counts: list[int]) -> list[float]:
        total = sum(counts) or 1
        return [c / total for c in counts]

    labels = [f"{lo}-{hi - 1} tokens" for lo, hi in zip(bins, bins[1:])]
    hist_rows = list(zip(labels, zip(shares(hist["log"]), shares(hist["calib"]), shares(hist["heldout"]))))
    hist_rows = [(label, list(v)) for label, v in hist_rows]
    under = m["under_covered"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>quantpipe calibration coverage</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1000px}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:left}.warn{color:#b00}</style>",
        "</head><body><h1>Calibration coverage</h1>",
        f"<p>{m['counts']['calib']} calibration and {m['counts']['heldout']} held-out texts sampled from "
        f"{m['counts']['cleaned']} cleaned records ({m['lines_read']} lines read) by strata "
        f"<code>{html.escape(', '.join(m['parameters']['strata']))}</code>, seed {m['seed']}.</p>",
    ]
    if under:
        parts.append(f"<p class='warn'>Under-covered (fewer than {m['parameters']['min_per_stratum']} in the "
                     f"calibration set): {html.escape(', '.join(under))}</p>")
    parts += [
        "<h2>Share per stratum: log vs sample</h2>",
        _bars(strata_rows, series, "share of each stratum in the log, the calibration set and the held-out set",
              "strata-shares"),
        "<h2>Token lengths</h2>",
        _bars(hist_rows, series, "token-length distribution of log and sample", "length-histogram"),
        "<h2>Strata</h2>",
        html_table([[s["name"], s["log_count"], f"{s['log_share']:.1%}", s["calib_count"], f"{s['calib_share']:.1%}",
                 s["heldout_count"], "yes" if s["under_covered"] else ""] for s in m["strata"]],
               ["stratum", "log", "log share", "calibration", "calibration share", "held-out", "under-covered"]),
        "<h2>Dropped while cleaning</h2>",
        html_table([[k, v] for k, v in m["dropped"].items()], ["reason", "records"]),
        "<h2>PII scrubbed</h2>",
        html_table([[f"<{k}>", v] for k, v in m["pii_scrubbed"].items()], ["placeholder", "replaced"]),
    ]
    if m.get("clusters"):
        c = m["clusters"]
        parts.append(f"<h2>Clusters</h2><p>k = {c['k']} by silhouette ({c['silhouette']}); "
                     f"names are each cluster's top TF-IDF terms.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
