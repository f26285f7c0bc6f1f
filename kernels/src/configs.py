"""Declared tile configurations: what the build stage autotunes over, per batch bucket.

Batch-1..16 decode is bound by reading the weights, so its configs keep BLOCK_M at the
minimum tl.dot allows (16) and split K across programs to occupy the GPU; prefill-sized
batches are compute-bound and take square-ish tiles with deeper pipelines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def as_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> GemmConfig:
        return GemmConfig(**{k: int(d[k]) for k in ("block_m", "block_n", "block_k", "split_k", "num_warps",
                                                   "num_stages")})

    def __str__(self) -> str:
        return (f"BM{self.block_m}_BN{self.block_n}_BK{self.block_k}_SK{self.split_k}"
                f"_w{self.num_warps}_s{self.num_stages}")


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256)

_GEMV = [GemmConfig(16, bn, bk, sk, 4, st) for bn in (32, 64, 128) for bk in (64, 128, 256)
         for sk in (1, 2, 4, 8) for st in (2, 3)]
_GEMM = [GemmConfig(bm, bn, bk, 1, 8 if bm * bn >= 128 * 128 else 4, st) for bm in (32, 64, 128)
         for bn in (64, 128) for bk in (32, 64, 128) for st in (3, 4)]

# The interpreter runs every program in Python (about 3 ms per program and K step), so it
# checks a few configs chosen to cover each code path: split K, M and N tails, K tails.
INTERPRET_CONFIGS = (GemmConfig(16, 32, 32), GemmConfig(16, 32, 64, split_k=2), GemmConfig(32, 64, 32))


def gemm_configs(bucket: int, split_k: bool = True) -> list[GemmConfig]:
    """The config space searched for batches of up to `bucket` rows (int8 GEMM: no split K)."""
    space = _GEMV if bucket <= 16 else [c for c in _GEMM if c.block_m <= max(32, bucket)]
    return [c for c in space if split_k or c.split_k == 1]


def bucket_for(rows: int, buckets: list[int]) -> int:
    """The smallest bucket holding `rows` (the largest when none does)."""
    for b in sorted(buckets):
        if rows <= b:
            return b
    return max(buckets)
