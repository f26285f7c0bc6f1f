"""Decode-sized Linear products over a whole model's weights, as a decode step reads them.

    .venv/bin/python benchmarks/bench_int8_decode.py [--threads 2] [--rows 1,2,4,8,16,24,32]

One pass multiplies a few activation rows into every Linear of the default model's 30
layers (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), each with its own
random weights: 106 M weights, more than the caches hold, so they stream from memory as
in a decode step (benchmarks/bench_int_kernels.py times one shape, cache-hot). Median ms
per pass over 11 passes, and the weight bytes read per second, for: bf16 prepacked
(the baseline's Linear), torch's `_weight_int8pack_mm`, quantpipe's int8 kernel
(csrc/int8_linear.cpp), int8 converted to bf16 then the dense GEMM (W8A16 past 16 rows),
and torch's int4 kernel at group 64.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import quantpipe  # noqa: E402,F401  (binds the runtime's import names)
from benchmarks.bench_int_kernels import median_us  # noqa: E402
from quantpipe.runtime.model.prepacked_linear import PrepackedLinear  # noqa: E402
from quantpipe.runtime.model.quantized import int8_kernel  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def pass_table(kinds: dict, weights: int, threads: int, rows_arg: str, inputs, skip=lambda name, rows: False) -> None:
    """Print ms per pass (and GB/s of weights read) for each kind {name: (bytes per weight, fn)}
    at each row count of `rows_arg`; `inputs(rows)` makes the activations fn takes."""
    print(f"{weights / 1e6:.0f} M weights per pass, {threads} threads; ms per pass (GB/s of weights read)")
    print("| rows | " + " | ".join(kinds) + " |")
    print("| --- |" + " --- |" * len(kinds))
    for rows in (int(r) for r in rows_arg.split(",")):
        x = inputs(rows)
        cells = []
        for name, (bytes_per_weight, fn) in kinds.items():
            if skip(name, rows):
                cells.append("-")
                continue
            ms = median_us(lambda: fn(x), repeats=11) / 1e3
            cells.append(f"{ms:.2f} ({weights * bytes_per_weight / ms / 1e6:.1f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,24,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = int8_kernel()
    if ext is None:
        sys.exit("quantpipe's int8 kernel is not built here "
                 "(no C++ compiler, or no AVX-512)")
    g = torch.Generator().manual_seed(0)
    bf16 = [PrepackedLinear(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)) for n, k in SHAPES]
    i8 = [(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
           (torch.rand(n, generator=g) / 50).bfloat16()) for n, k in SHAPES]
    i4 = [(torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32), 1),
           torch.rand(k // 64, n, 2, generator=g).bfloat16()) for n, k in SHAPES]
    weights = sum(n * k for n, k in SHAPES)
    kinds = {
        "bf16 prepacked": (2.0, lambda x: [lin(x[lin.in_features]) for lin in bf16]),
        "torch int8pack": (1.0, lambda x: [torch._weight_int8pack_mm(x[w.shape[1]], w, s) for w, s in i8]),
        "quantpipe int8": (1.0, lambda x: [ext.int8_linear_bf16(x[w.shape[1]], w, s) for w, s in i8]),
        "int8 -> bf16 GEMM": (1.0, lambda x: [F.linear(x[w.shape[1]], w.to(torch.bfloat16)) * s for w, s in i8]),
        "int4pack g64": (0.5 + 4 / 64, lambda x: [torch._weight_int4pack_mm_for_cpu(x[k], w, 64, s)
                                                  for (w, s), (_, k) in zip(i4, SHAPES)]),
    }
    pass_table(kinds, weights, args.threads, args.rows,
               lambda rows: {k: torch.randn(rows, k, generator=g).bfloat16() for k in (576, 1536)})

if __name__ == "__main__":
    main()
