"""Quantized artifacts against the bf16 baseline on CPU, side by side in one run.

    .venv/bin/python benchmarks/bench_quantized_speed.py ARTIFACT [ARTIFACT ...] [--repeats 3]

For the baseline and each artifact, loaded as `serve` would load them (dtype auto: bf16
on CPUs with native bf16), the runs alternate model by model for `--repeats` rounds:
- batch-1 decode tokens/s: a 64-token prompt, 128 greedy tokens (ignore_eos), the
  prefill excluded;
- offline throughput on chat-cpu (at `--length-scale`), 16 sequences in flight.
Prints medians and ratios to the baseline; each model's engine stays loaded.
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
    args = ap.parse_args()
    names = ["baseline"] + args.artifacts
    llms = {n: LLM(model=None if n == "baseline" else n, dtype="auto", max_num_seqs=16, max_model_len=2048, seed=0)
            for n in names}
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
    base = {k: statistics.median(v) for k, v in results["baseline"].items()}
    print(f"\ndtype: {llms['baseline'].engine.dtype}; chat-cpu x{args.length_scale}, {len(reqs)} requests, "
          f"{sum(outs)} output tokens; medians of {args.repeats}")
    print("| model | kernels | batch-1 decode tok/s | vs baseline | chat-cpu tok/s | vs baseline |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in names:
        med = {k: statistics.median(v) for k, v in results[n].items()}
        kinds = sorted({type(m).kernel for m in llms[n].engine.runner.model.modules() if hasattr(m, "kernel")})
        print(f"| {os.path.basename(n)} | {', '.join(kinds) or '-'} | {med['decode']:.1f} | "
              f"{med['decode'] / base['decode']:.2f}x | {med['throughput']:.1f} | "
              f"{med['throughput'] / base['throughput']:.2f}x |")


if __name__ == "__main__":
    main()
