"""The compressed-tensors `pack-quantized` layout, both ways: one implementation for the
quantize stage that writes it, the runtime that reads it and the kernels that check it.

Weights quantized to b bits, 1 <= b <= 8 (signed, in [-2^(b-1), 2^(b-1) - 1]), are stored
with an unsigned offset (q + 2^(b-1)) and packed densely along the input dimension: value i
of a row occupies bits i*b .. i*b + b - 1 of the row's bit stream, the lowest bits of each
int32 word first, so a value may straddle two words (3, 5, 6, 7 bits) and 32 values fill b
words: `weight_packed` [N, ceil(K * b / 32)]. For 2, 4 and 8 bits this is 32/b values per
word, none straddling. Asymmetric zero points are packed the same way along the output
dimension: `weight_zero_point` [ceil(N * b / 32), G]. Scales are stored as they are,
`weight_scale` [N, G] in the model dtype, and `weight_shape` holds [N, K].
"""

from __future__ import annotations

import torch

__all__ = ["container_bits", "packed_words", "pack_int32", "unpack_int32"]

MAX_BITS = 8


def container_bits(num_bits: int) -> int:
    """The kernel layout that holds b-bit integers exactly, with the same scales and zero points:
    4 bits up to 4, else 8 (the widths the CPU and Triton kernels take)."""
    return 4 if num_bits <= 4 else 8


def packed_words(num_bits: int, size: int) -> int:
    """int32 words holding `size` values of `num_bits` bits, densely packed."""
    if not 1 <= num_bits <= MAX_BITS:
        raise ValueError(f"num_bits must be 1 to {MAX_BITS} to pack into int32, got {num_bits}")
    return -(-size * num_bits // 32)


def _layout(num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(word, bit offset) of each of 32 values within the num_bits words they fill."""
    start = torch.arange(32, dtype=torch.int64) * num_bits
    return start // 32, start % 32


def pack_int32(q: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """Signed b-bit values -> int32 words along `dim` (padded with zeros to a whole word)."""
    if dim == 0:
        return pack_int32(q.t(), num_bits, dim=1).t().contiguous()
    words_out = packed_words(num_bits, q.shape[1])
    u = q.to(torch.int64) + (1 << (num_bits - 1))
    if u.numel() and (u.min() < 0 or u.max() >= 1 << num_bits):
        raise ValueError(f"values out of the {num_bits}-bit range")
    n, k = u.shape
    u = torch.nn.functional.pad(u, (0, (-k) % 32)).view(n, -1, 32)
    word, offset = _layout(num_bits)
    shifted = u << offset  # < 2^39: the bits past 32 belong to the next word
    words = torch.zeros(n, u.shape[1], num_bits + 1, dtype=torch.int64)
    words.index_add_(2, word, shifted & 0xFFFFFFFF)
    words.index_add_(2, word + 1, shifted >> 32)  # the last value ends on a word boundary: adds 0 to the spare
    words = words[:, :, :num_bits].reshape(n, -1)[:, :words_out]
    # sums of non-overlapping bit fields fit in 32 bits; reinterpret as signed int32.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """int32 words (dense, lowest bits first, unsigned offset 2^(b-1)) -> signed int8 values."""
    if dim == 0:
        return unpack_int32(packed.t(), num_bits, size, 1).t().contiguous()
    if packed.shape[1] != packed_words(num_bits, size):
        raise ValueError(f"{size} {num_bits}-bit values pack into {packed_words(num_bits, size)} int32 words, "
                         f"got {packed.shape[1]}")
    n, groups = packed.shape[0], -(-size // 32)
    words = torch.nn.functional.pad(packed.to(torch.int64) & 0xFFFFFFFF, (0, groups * num_bits - packed.shape[1]))
    # a zero word after each group's num_bits: the last value ends on the boundary, nothing of it is there
    words = torch.nn.functional.pad(words.view(n, groups, num_bits), (0, 1))
    word, offset = _layout(num_bits)
    both = words[:, :, word] | (words[:, :, word + 1] << 32)
    u = (both >> offset) & ((1 << num_bits) - 1)
    return (u.reshape(n, -1)[:, :size] - (1 << (num_bits - 1))).to(torch.int8)
