"""Mixed precision's sensitivity measurement with its float32 KL passes against the float64
log-softmax it replaced, side by side: time per Linear and the largest difference in the
table, on a real model, 4 probe sequences of 128 tokens (the stage's defaults).

    .venv/bin/python -m benchmarks.bench_sensitivity [--model gemma3-270m] [--layers 0,8,17] [--repeats 2]
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
    args = ap.parse_args()
    model, cfg, tok = load_model(args.model, torch.float32)
    layers = [int(i) for i in args.layers.split(",")] if args.layers else [0, cfg.num_layers // 2, cfg.num_layers - 1]
    names = [f"layers.{i}.{n}" for i in layers for n, _ in fused_linears(cfg, i)]
    ids = tok.encode(corpus_text()[:200000])
    probe = [ids[i * 128:(i + 1) * 128] for i in range(4)]
    schemes = QuantConfig(scheme="mixed", bits_budget=5, group_size=64).mixed_candidates()
    current = mixed.kl_rows
    times: dict[str, list[float]] = {"float64 log-softmax": [], "float32 passes": []}
    tables = {}
    for _ in range(args.repeats):  # alternating, so both see the same machine state
        for label, kl in (("float64 log-softmax", float64_kl), ("float32 passes", current)):
            mixed.kl_rows = kl  # the benchmark swaps the measurement's KL; the stage never does
            t = time.perf_counter()
            tables[label] = mixed.sensitivities(model, names, schemes, probe)
            times[label].append((time.perf_counter() - t) / len(names))
    mixed.kl_rows = current
    print(f"model {args.model or 'default'}, vocab {cfg.vocab_size}, {len(names)} Linears of layers {layers}, "
          f"4 probe sequences of 128 tokens, {len(schemes)} precisions")
    for label, ts in times.items():
        print(f"{label}: median {statistics.median(ts):.2f} s per Linear (range {min(ts):.2f}-{max(ts):.2f})")
    print(f"ratio float32 / float64: {statistics.median(times['float32 passes']) / statistics.median(times['float64 log-softmax']):.2f}")
    a, b = tables["float64 log-softmax"], tables["float32 passes"]
    diff = max(abs(a[n][s] - b[n][s]) for n in names for s in a[n])
    rel = max(abs(a[n][s] - b[n][s]) / a[n][s] for n in names for s in a[n])
    print(f"table: largest difference {diff:.2e} (relative {rel:.2e}); smallest entry {min(min(v.values()) for v in a.values()):.2e}")


if __name__ == "__main__":
    main()
