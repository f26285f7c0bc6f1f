"""Latency A/B: baseline and candidates served in turn by `quantpipe serve`, same load.

The workload is the held-out traffic itself: each request sends a held-out prompt (as
token ids, so both servers see identical input) and asks for as many tokens as the
logged reply had (capped at `max_output_tokens`, with ignore_eos so the length is
exact). Load never overlaps: every server is up (idle ones take no CPU) but only one
is driven at a time, and the order alternates per repeat (A B B A ...) so a machine that
slows down over the run does not favour one side. Ratios are candidate / baseline within a repeat;
the report gives their median and spread over repeats.

Two load shapes: a closed loop at a fixed concurrency (always), and, when the suite sets
`rate`, an open loop at that fixed request rate (arrivals evenly spaced, the same for
both sides), reported under `at_rate`. Every run keeps its per-request TTFT and TPOT
values, so the report can draw their distributions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from dataclasses import replace

import numpy as np

from quantpipe.eval.generation import prompts_from
from quantpipe.manifest import StageError
from quantpipe.runtime.bench.metrics import metric_values
from quantpipe.runtime.bench.runner import Runner, Target
from quantpipe.runtime.bench.scrape import Scraper
from quantpipe.runtime.server.process import Served, ServerStartError
from quantpipe.runtime.workload.materialize import Request
from quantpipe.runtime.workload.requests import RequestSpec

log = logging.getLogger("quantpipe.eval")
# (report key, record metric, statistic): what each run reports; ratios use the same keys
LATENCY_KEYS = [("ttft_p50_s", "ttft", 50), ("ttft_p99_s", "ttft", 99), ("tpot_p50_s", "tpot", 50),
                ("tpot_p99_s", "tpot", 99), ("e2e_p50_s", "e2e", 50), ("e2e_p95_s", "e2e", 95),
                ("e2e_p99_s", "e2e", 99)]


def workload(rows: list[dict], tokenizer, n: int, max_output_tokens: int, max_model_len: int) -> list[Request]:
    prompts = prompts_from([r["text"] for r in rows], tokenizer)
    reqs = []
    for i in range(n):  # cycle through the held-out set when asked for more requests than it has
        row, ids = rows[i % len(rows)], prompts[i % len(rows)]
        reply = max(1, len(tokenizer.encode(row["text"])) - len(ids))
        out = min(reply, max_output_tokens)
        ids = ids[: max_model_len - out]
        spec = RequestSpec(index=i, arrival_s=0.0, prompt_tokens=len(ids), output_tokens=out, new_tokens=len(ids))
        reqs.append(Request(spec, tokenizer.decode(ids), ids, "model"))
    return reqs


def at_rate(reqs: list[Request], rate: float) -> list[Request]:
    """The same requests, the i-th due i / rate seconds after the start."""
    return [replace(r, spec=replace(r.spec, arrival_s=i / rate)) for i, r in enumerate(reqs)]


async def _drive(url: str, reqs: list[Request], concurrency: int | None = None, rate: float | None = None) -> dict:
    """One run: a closed loop at `concurrency`, or (with `rate`) an open loop at that request rate."""
    runner = Runner(Target(url, send_token_ids=True, ignore_eos=True, timeout_s=600))
    await runner.preflight()
    await runner.closed_loop(reqs[:2], 2, stage="warmup")
    scraper = Scraper(url, runner.clock0, interval_s=0.25)
    scraper.start()
    t0 = runner.now()
    try:
        recs = await (runner.open_loop(at_rate(reqs, rate)) if rate else runner.closed_loop(reqs, concurrency))
    finally:
        t1 = runner.now()
        await scraper.stop()
        await runner.aclose()
    ok = [r for r in recs if r.ok]
    span = max(r.end for r in ok) - min(r.actual_send for r in recs) if ok else 0.0
    out = {"requests": len(recs), "completed": len(ok), "error_rate": 1 - len(ok) / len(recs),
           "timeout_rate": sum(r.timed_out for r in recs) / len(recs),
           "output_tokens_per_s": sum(r.output_tokens for r in ok) / span if span > 0 else 0.0}
    for key, metric, p in LATENCY_KEYS:
        values = metric_values(recs, metric)
        out[key] = float(statistics.quantiles(values, n=100, method="inclusive")[p - 1]) if len(values) > 1 else (
            float(values[0]) if len(values) else None)
    window = [v for _, v in scraper.window(t0, t1)]
    rss = [v["process_resident_memory_bytes"] for v in window if "process_resident_memory_bytes" in v]
    kv = [v["kv_cache_usage_perc"] for v in window if "kv_cache_usage_perc" in v]
    out["peak_rss_bytes"] = max(rss) if rss else None
    out["peak_kv_cache_usage"] = max(kv) if kv else None
    out["samples"] = {m: sorted(round(float(v), 5) for v in metric_values(recs, m)) for m in SAMPLED}
    return out


# Every server gets the same KV cache bytes: by default a server takes a share of the memory
# free when it starts, so servers started later (with the others already up) would get
# smaller caches, and preempt sooner, than the first. 1 GiB holds ~45k bf16 tokens of the
# default model, far more than `concurrency` requests in flight need.
KV_CACHE_MEMORY = "1GiB"
BOOTSTRAP = 2000  # resamples of the repeats for each ratio's interval
SAMPLED = ("ttft", "tpot")  # per-request values kept with each run, for the report's CDFs

# run key -> ratio key in the report (what gate policies name)
RATIOS = {**{k: k.removesuffix("_s") + "_ratio" for k, *_ in LATENCY_KEYS},
          "output_tokens_per_s": "output_tokens_per_s_ratio", "peak_rss_bytes": "peak_rss_ratio"}


def shapes_of(cfg: dict) -> dict[str, dict]:
    """The load shapes a suite's latency section asks for: a closed loop always, an open loop with `rate`."""
    shapes = {"concurrency": {"concurrency": cfg["concurrency"]}}
    if cfg.get("rate"):
        shapes["rate"] = {"rate": float(cfg["rate"])}
    return shapes


def measure(urls: list[str], reqs: list[Request], cfg: dict, names: list[str] | None = None) -> dict:
    """{shape: [runs of server 0, runs of server 1, ...]}: each server warmed up on the whole
    workload, then driven `repeats` times in alternating order (A B, B A, ...), one at a time."""
    names = names or [f"server {i}" for i in range(len(urls))]
    shapes = shapes_of(cfg)
    runs: dict[str, list[list[dict]]] = {shape: [[] for _ in urls] for shape in shapes}
    # Each server first serves the whole workload once, untimed: the first pass through new
    # prompt lengths pays one-off costs (allocator growth, kernel and weight-layout caches)
    # that made the first timed repeat of each side about twice as slow as the rest.
    for url, name in zip(urls, names):
        log.info("latency: warming up %s", name)
        asyncio.run(_drive(url, reqs, concurrency=cfg["concurrency"]))
    for r in range(cfg["repeats"]):
        order = range(len(urls)) if r % 2 == 0 else reversed(range(len(urls)))
        for i in order:
            for shape, kw in shapes.items():
                log.info("latency: repeat %d/%d, %s, fixed %s", r + 1, cfg["repeats"], names[i], shape)
                runs[shape][i].append(asyncio.run(_drive(urls[i], reqs, **kw)))
    return runs


def latency_ab(baseline: str | None, candidates: list[str], rows: list[dict], cfg: dict,
               max_model_len: int = 2048) -> dict:
    from quantpipe.runtime.llm_engine import resolve_device, resolve_dtype
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(baseline)
    dtype = str(resolve_dtype("auto", resolve_device("auto"))).removeprefix("torch.")  # what `serve` picks here
    reqs = workload(rows, tokenizer, cfg["requests"], cfg["max_output_tokens"], max_model_len)
    models = [baseline] + list(candidates)
    with contextlib.ExitStack() as stack:
        # Every model's server is started once, one after another, and stays up: an idle
        # server takes no CPU (measured: 0.1% of a core), and the repeats cost no restarts.
        servers = []
        for m in models:
            log.info("latency: starting the server for %s", m or "baseline")
            try:
                servers.append(stack.enter_context(Served(m, max_model_len, ["--kv-cache-memory", KV_CACHE_MEMORY])))
            except ServerStartError as e:
                raise StageError(f"latency: {e}") from None
        runs = measure([s.url for s in servers], reqs, cfg, [m or "baseline" for m in models])
    sections = []
    workload_info = {"requests": len(reqs), "prompt_tokens": sum(q.spec.prompt_tokens for q in reqs),
                     "output_tokens": sum(q.spec.output_tokens for q in reqs)}
    for j in range(1, len(models)):
        closed = compare(runs["concurrency"][0], runs["concurrency"][j])
        section = {**closed, "dtype": dtype, "workload": {**workload_info, "concurrency": cfg["concurrency"]}}
        if "rate" in runs:
            section["at_rate"] = {**compare(runs["rate"][0], runs["rate"][j]), "rate_rps": float(cfg["rate"])}
            section["error_rate"] = max(section["error_rate"], section["at_rate"]["error_rate"])
        sections.append(section)
    return {"candidates": sections}


def ratio_ci(per: list[float], replicates: int = BOOTSTRAP, seed: int = 0) -> dict:
    """The geometric mean of per-repeat paired ratios with a 95% bootstrap interval (repeats
    resampled): a gate rule bounds the end that is worse for the candidate, as the quality
    rules do, so a noisy A/B widens the interval and fails safe instead of passing by luck."""
    logs = np.log(np.asarray(per, dtype=np.float64))
    idx = np.random.default_rng(seed).integers(0, len(logs), size=(replicates, len(logs)))
    means = logs[idx].mean(axis=1)
    return {"point": float(np.exp(logs.mean())), "ci_lower": float(np.exp(np.percentile(means, 2.5))),
            "ci_upper": float(np.exp(np.percentile(means, 97.5))), "median": statistics.median(per),
            "min": min(per), "max": max(per), "repeats": len(per)}


def compare(base_runs: list[dict], cand_runs: list[dict]) -> dict:
    """Per-repeat ratios candidate / baseline (see ratio_ci), with the runs themselves."""
    ratios = {}
    for key, name in RATIOS.items():
        per = [c[key] / b[key] for b, c in zip(base_runs, cand_runs) if b.get(key) and c.get(key)]
        ratios[name] = ratio_ci(per) if per else None
    return {"baseline_runs": base_runs, "candidate_runs": cand_runs,
            "error_rate": max(run["error_rate"] for run in cand_runs), **ratios}
