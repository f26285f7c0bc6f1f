"""Mixed precision's sensitivity measurement against what it replaced, side by side: time
per Linear and the largest difference in the table, on a real model, by default 4 probe
sequences of 128 tokens (the stage's defaults).

    .venv/bin/python -m benchmarks.bench_sensitivity [--model gemma3-270m] [--layers 0,8,17] [--repeats 2]
        [--compare kl | batching] [--mixed-bits 4,8] [--group-sizes 64] [--samples 4] [--tokens 128]

--compare kl (the default): its float32 KL passes against the float64 log-softmax (before 631dccf).
--compare batching: the layers after the measured one run for all of its precisions and samples
at once, against one sequence per call (`max_rows=1`, the way before d52b60c's batching).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from quantpipe.quantize import QuantConfig, mixed
from quantpipe.runtime.model.config import fused_linears
from quantpipe.runtime.model.loader import load_model
from quantpipe.runtime.workload.text import corpus_text


@torch.inference_mode()
def float64_kl(base: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """KL per row from a float64 log-softmax over every entry: the measurement before 631dccf."""
    lb, lc = F.log_softmax(base.double(), -1), F.log_softmax(cand.double(), -1)
    return (lb.exp() * (lb - lc)).sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", default=None, help="decoder layers whose Linears are measured (default: first, middle, last)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compare", choices=("kl", "batching"), default="kl")
    ap.add_argument("--mixed-bits", default="4,8")
    ap.add_argument("--group-sizes", default="64")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    model, cfg, tok = load_model(args.model, torch.float32)
    layers = [int(i) for i in args.layers.split(",")] if args.layers else [0, cfg.num_layers // 2, cfg.num_layers - 1]
    names = [f"layers.{i}.{n}" for i in layers for n, _ in fused_linears(cfg, i)]
    ids = tok.encode(corpus_text()[:200000])
    n = args.tokens
    probe = [ids[i * n:(i + 1) * n] for i in range(args.samples)]
    schemes = QuantConfig(scheme="mixed", bits_budget=8, mixed_bits=args.mixed_bits,
                          mixed_group_sizes=args.group_sizes).mixed_candidates()
    current = mixed.kl_rows

    def measure(kl=current, **kw):
        def run():
            mixed.kl_rows = kl  # the benchmark swaps the measurement's KL; the stage never does
            try:
                return mixed.sensitivities(model, names, schemes, probe, **kw)
            finally:
                mixed.kl_rows = current
        return run

    sides = ({"float64 log-softmax": measure(float64_kl), "float32 passes": measure()} if args.compare == "kl" else
             {"one sequence per call": measure(max_rows=1), "batched": measure()})
    times: dict[str, list[float]] = {label: [] for label in sides}
    tables = {}
    for _ in range(args.repeats):  # alternating, so both see the same machine state
        for label, run in sides.items():
            t = time.perf_counter()
            tables[label] = run()
            times[label].append((time.perf_counter() - t) / len(names))
    print(f"model {args.model or 'default'}, vocab {cfg.vocab_size}, {len(names)} Linears of layers {layers}, "
          f"{args.samples} probe sequences of {n} tokens, {len(schemes)} precisions")
    for label, ts in times.items():
        print(f"{label}: median {statistics.median(ts):.2f} s per Linear (range {min(ts):.2f}-{max(ts):.2f})")
    before, after = sides
    print(f"ratio {after} / {before}: {statistics.median(times[after]) / statistics.median(times[before]):.2f}")
    a, b = tables[before], tables[after]
    diff = max(abs(a[n][s] - b[n][s]) for n in names for s in a[n])
    rel = max(abs(a[n][s] - b[n][s]) / a[n][s] for n in names for s in a[n])
    print(f"table: largest difference {diff:.2e} (relative {rel:.2e}); smallest entry {min(min(v.values()) for v in a.values()):.2e}")


if __name__ == "__main__":
    main()
