"""Quantized artifacts against the bf16 baseline on CPU, side by side in one run.

    .venv/bin/python benchmarks/bench_quantized_speed.py ARTIFACT [ARTIFACT ...] [--repeats 3]

For the baseline and each artifact, loaded as `serve` would load them (dtype auto: bf16
on CPUs with native bf16), the runs alternate model by model for `--repeats` rounds:
- batch-1 decode tokens/s: a 64-token prompt, 128 greedy tokens (ignore_eos), the
  prefill excluded;
- offline throughput on chat-cpu (at `--length-scale`), 16 sequences in flight;
- then, through the server (`quantpipe serve`, one per model, all started first, driven
  one at a time in alternating order): output tokens/s of the same chat-cpu requests at
  16 concurrent, streamed, with TTFT P50 and P99 and TPOT P50 (`--no-server` skips it).
`--also-without KERNELS` runs each artifact a second time with those CPU kernels of the
runtime turned off (engine argument `disable_cpu_kernels`, e.g. `packed`), in the same
rounds: before and after in one run. Prints medians and ratios to the baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_engine import bench_batch1, bench_quantpipe  # noqa: E402
from quantpipe.runtime import LLM  # noqa: E402
from quantpipe.runtime.workload import materialize, preset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--length-scale", type=float, default=0.5)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--also-without", metavar="KERNELS",
                    help="also run each artifact with these CPU kernels turned off (comma-separated)")
    args = ap.parse_args()
    names = ["baseline"] + args.artifacts
    if args.also_without:
        names += [f"{a} [without {args.also_without}]" for a in args.artifacts]
    llms = {}
    for n in names:
        llms[n] = LLM(model=path_of(n), dtype="auto", max_num_seqs=16, max_model_len=2048, seed=0,
                      disable_cpu_kernels=kernels_off(n))
    tok = llms["baseline"].get_tokenizer()
    spec = preset("chat-cpu", num_requests=args.num_requests, length_scale=args.length_scale)
    reqs = materialize(spec, tok)
    prompts, outs = [r.prompt_ids for r in reqs], [r.output_tokens for r in reqs]
    prompt = prompts[0][:64]
    results: dict[str, dict[str, list[float]]] = {n: {"decode": [], "throughput": []} for n in names}
    for r in range(args.repeats):
        for n in (names if r % 2 == 0 else reversed(names)):
            results[n]["decode"].append(bench_batch1(llms[n], None, prompt)["quantpipe_decode_tok_per_s"])
            results[n]["throughput"].append(bench_quantpipe(llms[n], prompts, outs)["tok_per_s"])
            print(n, {k: v[-1] for k, v in results[n].items()}, flush=True)
    kinds = {n: sorted({type(m).kernel for m in llms[n].engine.runner.model.modules() if hasattr(m, "kernel")})
             for n in names}
    dtype = llms["baseline"].engine.dtype
    del llms
    if not args.no_server:
        served(names, reqs, results, args.repeats)
    base = {k: statistics.median(v) for k, v in results["baseline"].items() if v}
    print(f"\ndtype: {dtype}; chat-cpu x{args.length_scale}, {len(reqs)} requests, "
          f"{sum(outs)} output tokens; medians of {args.repeats}")
    cols = [k for k in ("decode", "throughput", "server", "server_ttft_p50", "server_ttft_p99", "server_tpot_p50")
            if k in base]
    heads = {"decode": "batch-1 decode tok/s", "throughput": "chat-cpu offline tok/s",
             "server": "chat-cpu server tok/s (16 concurrent)", "server_ttft_p50": "server TTFT P50 s",
             "server_ttft_p99": "server TTFT P99 s", "server_tpot_p50": "server TPOT P50 s"}
    print("| model | kernels | " + " | ".join(f"{heads[c]} | vs baseline" for c in cols) + " |")
    print("| --- | --- |" + " --- | --- |" * len(cols))
    for n in names:
        med = {k: statistics.median(results[n][k]) for k in cols}
        label = n if path_of(n) is None else os.path.basename(path_of(n)) + n[len(path_of(n)):]
        print(f"| {label} | {', '.join(kinds[n]) or '-'} | "
              + " | ".join(f"{med[c]:.3g} | {med[c] / base[c]:.2f}x" for c in cols) + " |")


def path_of(name: str) -> str | None:
    return None if name == "baseline" else name.split(" [")[0]


def kernels_off(name: str) -> str:
    """The CPU kernels a model named "PATH [without NAMES]" runs without ("" for the others)."""
    return name.split(" [without ")[1].rstrip("]") if " [without " in name else ""


def served(names: list[str], reqs, results: dict, repeats: int) -> None:
    """chat-cpu at 16 concurrent through one server per model, driven in alternating order."""
    import asyncio
    import contextlib

    from quantpipe.eval.latency import KV_CACHE_MEMORY, _drive
    from quantpipe.runtime.server.process import Served

    with contextlib.ExitStack() as stack:
        urls = {}
        for n in names:
            flags = ["--kv-cache-memory", KV_CACHE_MEMORY, "--max-num-seqs", "16"]
            if kernels_off(n):
                flags += ["--disable-cpu-kernels", kernels_off(n)]
            urls[n] = stack.enter_context(Served(path_of(n), 2048, flags)).url
        for r in range(repeats):
            for n in (names if r % 2 == 0 else list(reversed(names))):
                run = asyncio.run(_drive(urls[n], reqs, concurrency=16))
                for key, value in (("server", run["output_tokens_per_s"]), ("server_ttft_p50", run["ttft_p50_s"]),
                                   ("server_ttft_p99", run["ttft_p99_s"]), ("server_tpot_p50", run["tpot_p50_s"])):
                    results[n].setdefault(key, []).append(value)
                print(n, "server", {k: round(v[-1], 4) for k, v in results[n].items()}, flush=True)

if __name__ == "__main__":
    main()
