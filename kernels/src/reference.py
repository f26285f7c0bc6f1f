"""Plain-torch versions of each kernel's semantics: the tests' judge and the runtime's fallback.

Each computes in float32 (integer products exactly, in int64) from the same inputs the
kernel gets, so a kernel's error against its reference is its own rounding alone.
"""

from __future__ import annotations

import math

import torch

from quantpipe.formats.packing import unpack_int32
from quantpipe.runtime.model.quantized import quantize_per_token


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                      group_size: int | None, k: int) -> torch.Tensor:
    """compressed-tensors' packed weights -> float32 [N, K]."""
    q = unpack_int32(packed.cpu(), bits, k).float().to(packed.device)
    n = q.shape[0]
    gs = group_size or k
    g = q.reshape(n, k // gs, gs)
    if zero is not None:
        g = g - zero.float().unsqueeze(-1)
    return (g * scale.float().unsqueeze(-1)).reshape(n, k)


def mixed_gemm_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   bits: int, group_size: int | None) -> torch.Tensor:
    return x.float() @ dequantize_packed(packed, scale, zero, bits, group_size, x.shape[1]).t()


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's dynamic per-token INT8 grid: (int8 values [M, K], float32 scales [M])."""
    q, s = quantize_per_token(x.float())
    return q.to(torch.int8), s.reshape(-1)


def w8a8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Per-token INT8 activations x per-channel INT8 weights [N, K], the product exact."""
    xq, xs = quantize_per_token_ref(x)
    acc = (xq.cpu().to(torch.int64) @ weight.cpu().to(torch.int64).t()).to(x.device)
    return acc.double().mul(xs.double()[:, None]).mul(weight_scale.double().reshape(1, -1)).float()


def paged_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor
                     ) -> torch.Tensor:
    """One query per sequence over its K/V as a cache read returns them ([B, L, KVH, D], padded).

    q [B, H, D]; positions at or past context_lens[b] are masked out.
    """
    b, h, d = q.shape
    gqa = h // k.shape[2]
    kf = k.float().repeat_interleave(gqa, dim=2)  # [B, L, H, D]
    vf = v.float().repeat_interleave(gqa, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.float(), kf) / math.sqrt(d)
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", scores.softmax(-1), vf)
