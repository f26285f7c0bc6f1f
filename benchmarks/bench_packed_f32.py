"""Float32 Linear products over a whole model's weights: the float32 model against packed weights.

    .venv/bin/python benchmarks/bench_packed_f32.py [--threads 2] [--rows 1,2,4,8,16,32,64,128,512]

Where a CPU has no native bf16 (AVX2 only), the runtime serves float32. One pass multiplies
a few activation rows into every Linear of the default model's 30 layers (qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536), each with its own random weights: 106 M
weights, streamed from memory as in a decode step. Median ms per pass over 11 passes and,
in brackets, the weight bytes read per second, for: the float32 model's Linear (wide ones
row-blocked, as the runtime serves them) and quantpipe's packed kernel
(csrc/packed_linear.cpp) on int8 per channel and on 4-bit group 64 as served (its path
chosen by the row count), then int8 forced onto each path: decode (tiles widened in L1,
up to 32 rows here), tiles (L2 tiles, a float32 GEMM each) and prefill (the whole weight
widened, one GEMM).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import quantpipe  # noqa: E402,F401  (binds the runtime's import names)
from benchmarks.bench_int8_decode import SHAPES, pass_table  # noqa: E402  (the same 30 layers' weights)
from quantpipe.runtime.model.blocked_linear import BLOCK_ROWS, RowBlockedLinear  # noqa: E402
from quantpipe.runtime.model.cpu_attention import extension  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = extension()
    if ext is None:
        sys.exit("quantpipe's CPU module could not be built here (no C++ compiler?)")
    g = torch.Generator().manual_seed(0)
    f32 = []
    for n, k in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False)
        f32.append(RowBlockedLinear(lin) if n > BLOCK_ROWS else lin)
    i8 = [(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, 1, generator=g) / 50)
          for n, k in SHAPES]
    i4 = [(torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
           torch.rand(n, k // 64, generator=g) / 50, torch.full((n, k // 64), 8.0)) for n, k in SHAPES]
    weights = sum(n * k for n, k in SHAPES)
    def int8(*paths):  # (max_decode_rows, max_tile_rows) forces a path; () takes the kernel's own choice
        return lambda x: [ext.packed_linear_f32(x[w.shape[1]], w, 8, s, None, *paths) for w, s in i8]

    big = 1 << 30
    kinds = {
        "float32": (4.0, lambda x: [lin(x[lin.in_features]) for lin in f32]),
        "int8 as served": (1.0, int8()),
        "int4 g64 as served": (0.5 + 4 / 64, lambda x: [ext.packed_linear_f32(x[2 * w.shape[1]], w, 4, s, z)
                                                        for w, s, z in i4]),
        "int8 decode path": (1.0, int8(big, big)),
        "int8 tiles path": (1.0, int8(0, big)),
        "int8 prefill path": (1.0, int8(0, 0)),
    }
    pass_table(kinds, weights, args.threads, args.rows,
               lambda rows: {k: torch.randn(rows, k, generator=g) for k in (576, 1536)},
               skip=lambda name, rows: name == "int8 decode path" and rows > 32)

if __name__ == "__main__":
    main()
