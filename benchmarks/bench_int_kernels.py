"""torch's CPU int kernels against bf16 F.linear, by rows, on the default model's Linear shapes.

    .venv/bin/python benchmarks/bench_int_kernels.py [--threads 2]

Median microseconds of: bf16 F.linear; `_weight_int8pack_mm`; the int8 weights converted
to bf16 then F.linear, scaled per output (what Int8PackLinear does past
INT8PACK_MAX_ROWS); `_weight_int4pack_mm_for_cpu` at group 64. Rows are tokens in one
step: 1-16 for decode batches, hundreds for a prefill chunk.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv_proj": (960, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
ROWS = (1, 8, 16, 32, 64, 128, 512)


def median_us(fn, repeats: int = 40) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print("| Linear (N x K) | rows | bf16 us | int8pack | int8 -> bf16 GEMM | int4pack g64 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (n, k) in SHAPES.items():
        q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = (torch.rand(n, generator=g) / 50).bfloat16()
        w = (q8.to(torch.bfloat16) * scale[:, None]).contiguous()
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), generator=g,
                                                                          dtype=torch.int32), 1)
        sz = torch.stack([torch.rand(k // 64, n, generator=g), torch.zeros(k // 64, n)], -1).bfloat16()
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g).bfloat16()
            base = median_us(lambda: F.linear(x, w))
            i8 = median_us(lambda: torch._weight_int8pack_mm(x, q8, scale))
            conv = median_us(lambda: F.linear(x, q8.to(torch.bfloat16)) * scale)
            i4 = median_us(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, 64, sz))
            print(f"| {name} ({n} x {k}) | {rows} | {base:.0f} | {i8:.0f} ({base / i8:.2f}x) | "
                  f"{conv:.0f} ({base / conv:.2f}x) | {i4:.0f} ({base / i4:.2f}x) |")


if __name__ == "__main__":
    main()
