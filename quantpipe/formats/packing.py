"""The compressed-tensors `pack-quantized` layout, both ways: one implementation for the
quantize stage that writes it, the runtime that reads it and the kernels that check it.

Weights quantized to b bits (signed, in [-2^(b-1), 2^(b-1) - 1]) are stored with an
unsigned offset (q + 2^(b-1)) and packed 32/b values per int32 along the input
dimension, the lowest bits holding the first value: `weight_packed` [N, ceil(K/p)].
Asymmetric zero points are packed the same way along the output dimension:
`weight_zero_point` [ceil(N/p), G]. Scales are stored as they are, `weight_scale`
[N, G] in the model dtype, and `weight_shape` holds [N, K].
"""

from __future__ import annotations

import torch

__all__ = ["pack_factor", "pack_int32", "unpack_int32"]


def pack_factor(num_bits: int) -> int:
    if num_bits not in (2, 4, 8):
        raise ValueError(f"num_bits must be 2, 4 or 8 to pack into int32, got {num_bits}")
    return 32 // num_bits


def pack_int32(q: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """Signed b-bit values -> int32 words along `dim` (padded with zeros to a whole word)."""
    p = pack_factor(num_bits)
    offset = 1 << (num_bits - 1)
    u = (q.to(torch.int64) + offset)
    if u.min() < 0 or u.max() >= 1 << num_bits:
        raise ValueError(f"values out of the {num_bits}-bit range")
    if dim == 0:
        return pack_int32(q.t(), num_bits, dim=1).t().contiguous()
    n, k = u.shape
    pad = (-k) % p
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.view(n, -1, p)
    shifts = torch.arange(p, dtype=torch.int64) * num_bits
    words = (u << shifts).sum(-1)
    # int64 sums of non-overlapping bit fields fit in 32 bits; reinterpret as signed int32.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """int32 words (lowest bits first, unsigned offset 2^(b-1)) -> signed int8 values."""
    if dim == 0:
        return unpack_int32(packed.t(), num_bits, size, 1).t().contiguous()
    p = pack_factor(num_bits)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(p, dtype=torch.int64) * num_bits
    u = (words.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return (u.reshape(packed.shape[0], -1)[:, :size] - (1 << (num_bits - 1))).to(torch.int8)
