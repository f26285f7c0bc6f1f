"""Outputs: console table (rich), CSV of every request, self-contained HTML with plots."""

from __future__ import annotations

import base64
import csv
import html
import io
from pathlib import Path

import numpy as np

from quantpipe.runtime.bench.metrics import metric_values
from quantpipe.runtime.bench.records import CSV_COLUMNS, csv_row
from quantpipe.runtime.bench.results import BenchResult


def _ms(st: dict, key: str = "p99") -> str:
    v = (st or {}).get(key, {}).get("value")
    return "-" if v is None else f"{v * 1000:.1f}"


def console(result: BenchResult, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    if not con.is_terminal:
        con.width = max(con.width, 180)  # logs and pipes: do not squeeze the table
    t = Table(title=f"quantpipe bench {result.kind}" + (" (INTERRUPTED)" if result.interrupted else ""))
    for col in ("stage", "target/s", "sent/s", "done/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p99",
                "ITL p99", "E2E p99", "E2E* p99", "lag p99", "errors"):
        t.add_column(col, justify="right")
    for st in result.stages:
        s = st.summary
        m = s.get("metrics", {})
        lag = s.get("schedule_lag", {}).get("p99")
        t.add_row(st.name + (" [sat]" if st.saturated else ""),
                  f"{st.target_rate:.2f}" if st.target_rate else (f"c={st.concurrency}" if st.concurrency else "-"),
                  f"{s.get('achieved_send_rate') or 0:.2f}", f"{s.get('request_throughput', 0):.2f}",
                  f"{s.get('output_token_throughput', 0):.0f}", _ms(m.get("ttft"), "p50"), _ms(m.get("ttft")),
                  _ms(m.get("tpot")), _ms(m.get("itl")), _ms(m.get("e2e")), _ms(m.get("e2e_intended")),
                  "-" if lag is None else f"{lag * 1000:.1f}",
                  f"{s.get('failed', 0)} ({s.get('error_rate', 0):.1%})")
    con.print(t)
    con.print("latencies in ms; E2E* counts from the intended send time (coordinated omission)")
    for st in result.stages:
        if st.summary.get("slo"):
            verdict = "met" if st.summary["slo_met"] else "MISSED"
            con.print(f"{st.name}: SLOs {verdict}; goodput {st.summary.get('goodput', 0):.2f} req/s")
        if st.summary.get("errors"):
            con.print(f"{st.name}: errors by kind {st.summary['errors']}")
    if result.knee:
        k = result.knee
        con.print(f"knee: {k['stage']} ({k['stage_throughput']:.2f} req/s); plateau {k['throughput']:.2f} req/s; "
                  f"explanation: {k['explanation']}")
    if result.capacity:
        c = result.capacity
        line = (f"capacity: {c['max_rate']:.2f} req/s ({c['basis']}); recommended {c['recommended_rate']:.2f} req/s "
                f"with {c['headroom']:.0%} headroom")
        if c.get("replicas"):
            line += f"; replicas for {c['target_peak']:.2f} req/s peak: {c['replicas']}"
        con.print(line)
    if result.soak:
        con.print(f"soak: {result.soak['verdict']}")
    if result.error:
        con.print(f"[red]error: {result.error}[/red]")


def write_csv(result: BenchResult, path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for st in result.stages:
            for r in st.records:
                w.writerow(["" if v is None else v for v in csv_row(r)])


# ---- HTML ---------------------------------------------------------------------------------
def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _figures(result: BenchResult) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2e")):
        for st in result.stages:
            x = np.sort(metric_values(st.records, metric)) * 1000
            if len(x):
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=st.name)
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("CDF")
        ax.set_xscale("symlog", linthresh=1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figs.append(("Latency CDFs per stage", _png(fig)))

    ramp = sorted((s for s in result.stages if s.mode == "open" and s.target_rate), key=lambda s: s.target_rate)
    if ramp:
        fig, ax = plt.subplots(figsize=(8, 4))
        x = [s.target_rate for s in ramp]
        ax.plot(x, [s.summary["request_throughput"] for s in ramp], "o-", label="throughput (req/s)")
        ax.plot(x, x, ":", color="gray", label="offered")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("req/s")
        ax2 = ax.twinx()
        ax2.plot(x, [(s.summary["metrics"]["e2e"].get("p99", {}).get("value") or np.nan) * 1000 for s in ramp],
                 "s--", color="C3", label="E2E p99 (ms)")
        ax2.set_ylabel("E2E p99 (ms)")
        if result.knee and result.knee.get("rate"):
            ax.axvline(result.knee["rate"], color="C2", ls="--", label=f"knee ({result.knee['explanation']})")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        figs.append(("Throughput and P99 latency vs offered load", _png(fig)))

    if result.server_series:
        names = sorted({k for _, v in result.server_series for k in v
                        if k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                 "process_resident_memory_bytes")})
        if names:
            fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.2 * len(names)), sharex=True, squeeze=False)
            for ax, name in zip(axes[:, 0], names):
                scale, label = (2**20, name[:-len("bytes")] + "MiB") if name.endswith("_bytes") else (1, name)
                pts = [(t, v[name] / scale) for t, v in result.server_series if name in v]
                ax.plot([p[0] for p in pts], [p[1] for p in pts])
                ax.set_ylabel(label, fontsize=8)
                for st in result.stages:
                    ax.axvspan(st.t_start, st.t_end, alpha=0.05)
            axes[-1, 0].set_xlabel("time (s)")
            figs.append(("Server metrics over time", _png(fig)))
    return figs


def write_html(result: BenchResult, path: str | Path) -> None:
    from rich.console import Console

    buf = io.StringIO()
    console(result, Console(file=buf, width=200, force_terminal=False, color_system=None))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>quantpipe bench {result.kind}</title>",
             "<style>body{font-family:sans-serif;margin:2em} pre{font-size:12px} img{max-width:100%}</style>",
             f"</head><body><h1>quantpipe bench {result.kind}</h1>",
             f"<pre>{html.escape(buf.getvalue())}</pre>"]
    for title, png in _figures(result):
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>")
    parts.append("<h2>Run metadata</h2><pre>" + html.escape(str(result.meta)) + "</pre></body></html>")
    Path(path).write_text("\n".join(parts))
