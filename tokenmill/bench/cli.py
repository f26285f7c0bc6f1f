"""`tokenmill bench {run,sweep,compare,mock-server}`; hooked in via register(subparsers)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    run = bsub.add_parser("run", help="one load level: open loop at --rate, or closed loop at --concurrency")
    _common(run)
    run.add_argument("--rate", type=float, default=None, help="req/s (default: the workload's)")
    run.add_argument("--concurrency", type=int, default=None, help="closed loop with N in flight")
    run.set_defaults(func=cmd_run)

    sw = bsub.add_parser("sweep", help="baseline -> ramp -> knee -> capacity (-> soak)")
    _common(sw)
    sw.add_argument("--stage-duration", type=float, default=30.0, help="seconds of arrivals per level")
    sw.add_argument("--max-stage-requests", type=int, default=5000)
    sw.add_argument("--baseline-requests", type=int, default=10)
    sw.add_argument("--growth", type=float, default=2.0, help="rate multiplier between ramp levels")
    sw.add_argument("--max-levels", type=int, default=10)
    sw.add_argument("--soak-duration", type=float, default=0.0, help="seconds below the knee (0 = skip)")
    sw.add_argument("--soak-fraction", type=float, default=0.7)
    sw.add_argument("--headroom", type=float, default=0.35, help="recommended = capacity x (1 - headroom)")
    sw.add_argument("--target-peak", type=float, default=None, help="req/s to size replicas for")
    sw.set_defaults(func=cmd_sweep)

    cmp_ = bsub.add_parser("compare", help="compare two result JSON files (A = before, B = after)")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    cmp_.add_argument("--json", default=None, help="also write the comparison here")
    cmp_.set_defaults(func=cmd_compare)

    from tokenmill.bench import mock_server

    mock = bsub.add_parser("mock-server", help="fake OpenAI-compatible server with a latency model")
    mock_server.add_arguments(mock)
    mock.set_defaults(func=mock_server.serve)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--workload", default="chat", help="preset name or YAML/JSON spec file")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply all token lengths")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals (run)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="default: first id from /v1/models")
    p.add_argument("--tokenizer", choices=("auto", "server", "local", "approx"), default="auto")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--send-token-ids", action="store_true", help="completions: send prompt as token ids")
    p.add_argument("--max-concurrency", type=int, default=None, help="client cap on in-flight requests")
    p.add_argument("--slo", default=None, help="e.g. ttft_p99=2s,tpot_p99=100ms")
    p.add_argument("--scrape-interval", type=float, default=0.5, help="seconds between /metrics scrapes")
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument("--name", default=None, help="output file stem (default: <kind>-<time>)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no console table")


def _spec(args):
    from tokenmill.workload import load_workload

    spec = load_workload(args.workload)
    if args.length_scale != 1.0:
        spec = spec.scaled_lengths(args.length_scale)
    if args.seed is not None:
        spec = replace(spec, seed=args.seed)
    if args.num_requests is not None or args.duration is not None:
        spec = replace(spec, num_requests=args.num_requests, duration_s=args.duration)
    if getattr(args, "rate", None) is not None:
        spec = spec.with_rate(args.rate)
    return spec


def _progress(enabled: bool):
    if not enabled:
        return None, None
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("errors: {task.fields[errors]}"), transient=False)

    def stage(name: str, total: int):
        tid = prog.add_task(name, total=total, errors=0)
        errs = [0]

        def done(rec) -> None:
            errs[0] += not rec.ok
            prog.update(tid, advance=1, errors=errs[0])
        return done
    return prog, stage


def _execute(args, kind: str) -> int:
    from tokenmill.bench.loop import run_async
    from tokenmill.bench.metrics import parse_slos
    from tokenmill.bench.report import console, write_csv, write_html
    from tokenmill.bench.results import BenchResult
    from tokenmill.bench.runner import BenchError, Runner, Target
    from tokenmill.bench.scrape import Scraper
    from tokenmill.bench.sweep import Bench, SweepConfig
    from tokenmill.workload import get_tokenizer

    try:
        spec = _spec(args)
        slos = parse_slos(args.slo)
        if kind == "run" and args.concurrency is None and spec.arrival.process == "trace" and args.rate:
            raise ValueError("--rate cannot be used with a trace workload")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = SweepConfig()
    if kind == "sweep":
        cfg = SweepConfig(stage_duration_s=args.stage_duration, max_stage_requests=args.max_stage_requests,
                          baseline_requests=args.baseline_requests, growth=args.growth, max_levels=args.max_levels,
                          soak_duration_s=args.soak_duration, soak_fraction=args.soak_fraction,
                          headroom=args.headroom, target_peak=args.target_peak,
                          max_concurrency=args.max_concurrency)
    else:
        cfg = replace(cfg, max_concurrency=args.max_concurrency)
    target = Target(args.url, args.endpoint, args.model, args.timeout, not args.no_stream, args.send_token_ids,
                    spec.ignore_eos)
    runner = Runner(target)
    result = BenchResult(kind, meta={"url": args.url, "workload": spec.to_dict(), "slos": [str(s) for s in slos],
                                     "started_unix": time.time(), "argv": sys.argv[1:]})
    prog, stage_cb = _progress(not args.no_progress and sys.stderr.isatty())
    scraper = Scraper(args.url, runner.clock0, args.scrape_interval)
    rc = 0

    async def main() -> None:
        try:
            result.meta["model"] = await runner.preflight()
            tok = get_tokenizer(args.tokenizer, base_url=args.url, model=None)
            target.tokenizer = tok
            result.meta["tokenizer"] = tok.source
            scraper.start()
            bench = Bench(runner, scraper, spec, tok, slos, cfg, result, stage_cb)
            if kind == "sweep":
                await bench.sweep()
            else:
                from tokenmill.workload import materialize

                reqs = materialize(spec, tok)
                await bench.stage("run", reqs, rate=None if args.concurrency else spec.arrival.mean_rate(),
                                  concurrency=args.concurrency)
        finally:
            await scraper.stop()
            await runner.aclose()

    try:
        if prog:
            prog.start()
        run_async(main())
    except KeyboardInterrupt:
        result.interrupted = True
        rc = 130
        print("\ninterrupted: writing the records collected so far", file=sys.stderr)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - report, keep partial results
        result.error = f"{type(e).__name__}: {e}"
        rc = 1
    finally:
        if prog:
            prog.stop()
    result.server_series = scraper.series
    if not result.stages:
        print(f"error: {result.error or 'no requests were sent'}", file=sys.stderr)
        return rc or 1
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (args.name or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}")
    result.save(f"{stem}.json")
    write_csv(result, f"{stem}.csv")
    write_html(result, f"{stem}.html")
    if not args.quiet:
        console(result)
    print(f"wrote {stem}.json, {stem}.csv, {stem}.html")
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
    return rc


def cmd_run(args) -> int:
    return _execute(args, "run")


def cmd_sweep(args) -> int:
    return _execute(args, "sweep")


def cmd_compare(args) -> int:
    import json

    from tokenmill.bench.compare import compare, print_comparison
    from tokenmill.bench.results import BenchResult

    try:
        a, b = BenchResult.load(args.a), BenchResult.load(args.b)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = compare(a, b)
    print_comparison(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
