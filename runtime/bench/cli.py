"""`quantpipe bench {run,sweep,compare,mock-server}`: the click group `bench`."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import click

from quantpipe.runtime.bench import mock_server


def common_options(f):
    """Options shared by `bench run` and `bench sweep`."""
    opts = [
        click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="server base URL"),
        click.option("--workload", default="chat", show_default=True, help="preset name or YAML/JSON spec file"),
        click.option("--length-scale", type=float, default=1.0, show_default=True,
                     help="multiply all token lengths"),
        click.option("--num-requests", type=int, default=None),
        click.option("--duration", type=float, default=None, help="seconds of arrivals (run)"),
        click.option("--seed", type=int, default=None),
        click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions",
                     show_default=True),
        click.option("--model", default=None, help="default: first id from /v1/models"),
        click.option("--tokenizer", type=click.Choice(["auto", "server", "local", "approx"]), default="auto",
                     show_default=True),
        click.option("--timeout", type=float, default=300.0, show_default=True, help="per-request timeout (s)"),
        click.option("--no-stream", is_flag=True),
        click.option("--send-token-ids", is_flag=True, help="completions: send prompt as token ids"),
        click.option("--max-concurrency", type=int, default=None, help="client cap on in-flight requests"),
        click.option("--slo", default=None, help="e.g. ttft_p99=2s,tpot_p99=100ms"),
        click.option("--scrape-interval", type=float, default=0.5, show_default=True,
                     help="seconds between /metrics scrapes"),
        click.option("--output-dir", default="bench-results", show_default=True),
        click.option("--name", default=None, help="output file stem (default: <kind>-<time>)"),
        click.option("--no-progress", is_flag=True),
        click.option("--quiet", is_flag=True, help="no console table"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@click.group("bench", help="Load-test an OpenAI-compatible server.")
def bench() -> None:
    pass


@bench.command("run", help="One load level: open loop at --rate, or closed loop at --concurrency.")
@common_options
@click.option("--rate", type=float, default=None, help="req/s (default: the workload's)")
@click.option("--concurrency", type=int, default=None, help="closed loop with N in flight")
def run_command(**options) -> int:
    return _execute(argparse.Namespace(**options), "run")


@bench.command("sweep", help="baseline -> ramp -> knee -> capacity (-> soak)")
@common_options
@click.option("--stage-duration", type=float, default=30.0, show_default=True, help="seconds of arrivals per level")
@click.option("--min-stage-requests", type=click.IntRange(min=1), default=20, show_default=True,
              help="requests of each level at the least, however low its rate (a low rate then runs longer)")
@click.option("--max-stage-requests", type=click.IntRange(min=1), default=5000, show_default=True)
@click.option("--baseline-requests", type=int, default=10, show_default=True)
@click.option("--growth", type=float, default=2.0, show_default=True, help="rate multiplier between ramp levels")
@click.option("--max-levels", type=int, default=10, show_default=True)
@click.option("--soak-duration", type=float, default=0.0, show_default=True, help="seconds below the knee (0 = skip)")
@click.option("--soak-fraction", type=float, default=0.7, show_default=True)
@click.option("--headroom", type=float, default=0.35, show_default=True,
              help="recommended = capacity x (1 - headroom)")
@click.option("--target-peak", type=float, default=None, help="req/s to size replicas for")
def sweep_command(**options) -> int:
    return _execute(argparse.Namespace(**options), "sweep")


@bench.command("compare", help="Compare two result JSON files (A = before, B = after).")
@click.argument("a")
@click.argument("b")
@click.option("--json", "json_path", default=None, help="also write the comparison here")
def compare_command(a: str, b: str, json_path: str | None) -> int:
    return cmd_compare(argparse.Namespace(a=a, b=b, json=json_path))


@bench.command("mock-server", help="Fake OpenAI-compatible server with a latency model.")
@mock_server.mock_options
def mock_command(**options) -> int:
    return mock_server.serve(argparse.Namespace(**options))


def _spec(args):
    from quantpipe.runtime.workload import load_workload

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
    from quantpipe.runtime.bench.loop import run_async
    from quantpipe.runtime.bench.metrics import parse_slos
    from quantpipe.runtime.bench.report import console, write_csv, write_html
    from quantpipe.runtime.bench.results import BenchResult
    from quantpipe.runtime.bench.runner import BenchError, Runner, Target
    from quantpipe.runtime.bench.scrape import Scraper
    from quantpipe.runtime.bench.sweep import Bench, SweepConfig
    from quantpipe.runtime.workload import get_tokenizer

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
        if args.min_stage_requests > args.max_stage_requests:
            print(f"error: --min-stage-requests {args.min_stage_requests} is above --max-stage-requests "
                  f"{args.max_stage_requests}", file=sys.stderr)
            return 2
        cfg = SweepConfig(stage_duration_s=args.stage_duration, min_stage_requests=args.min_stage_requests,
                          max_stage_requests=args.max_stage_requests,
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
                from quantpipe.runtime.workload import materialize

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


def cmd_compare(args) -> int:
    import json

    from quantpipe.runtime.bench.compare import compare, print_comparison
    from quantpipe.runtime.bench.results import BenchResult

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
