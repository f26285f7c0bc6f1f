"""W4A16 / W8A16: activations times packed integer weights, dequantized in registers.

Weights are read in compressed-tensors' `pack-quantized` layout as stored: int32 words
[N, ceil(K / (32 / bits))], the lowest bits holding the first value, each value offset by
2^(bits-1). Scales are [N, K / group] (one column per channel when per-channel), zero
points [N, K / group] as numbers (the artifact packs them along N; they are unpacked
once at load, being K/group times smaller than the weights). Accumulation is fp32.

One kernel serves decode and prefill: its config chooses the tile, and split K (several
programs per output tile, each summing a slice of K into an fp32 partial) keeps the GPU
busy when a batch of one row leaves only N / BLOCK_N tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantpipe.kernels.common import interpreting
from quantpipe.kernels.configs import GemmConfig
from quantpipe.kernels.plan import unsupported_reason


@triton.jit
def _mixed_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, num_words, group_size, k_per_split,
                       stride_xm, stride_wn, stride_sn, stride_om, stride_split,
                       BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PACK: tl.constexpr = 32 // BITS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_begin + k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        wn_ok = n_ok[:, None] & k_ok[None, :]
        # Each int32 word is loaded once and split into its PACK values in registers; values
        # past K (the zero padding of the last word) meet x's zeros, so they add nothing.
        offs_w = (k_begin + k0) // PACK + tl.arange(0, BLOCK_K // PACK)
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                        mask=n_ok[:, None] & (offs_w < num_words)[None, :], other=0)
        u = (words[:, :, None] >> (tl.arange(0, PACK) * BITS)[None, None, :]) & ((1 << BITS) - 1)
        w = tl.reshape(u, (BLOCK_N, BLOCK_K)).to(tl.float32) - (1 << (BITS - 1))
        s_off = offs_n[:, None] * stride_sn + (offs_k // group_size)[None, :]
        if HAS_ZERO:
            w = w - tl.load(z_ptr + s_off, mask=wn_ok, other=0.0).to(tl.float32)
        w = w * tl.load(s_ptr + s_off, mask=wn_ok, other=0.0).to(tl.float32)
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong: multiply in fp32 there
            acc += tl.dot(x.to(tl.float32), tl.trans(w))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out_off = offs_m[:, None] * stride_om + offs_n[None, :]
    o_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * stride_split + out_off, acc, mask=o_ok)
    else:
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


def mixed_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               bits: int, group_size: int | None, config: GemmConfig) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(packed).T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = packed.shape[0]
    reason = unsupported_reason(bits, group_size, k)
    if reason:
        raise ValueError(f"no mixed-input GEMM kernel for {reason}")
    if packed.dtype != torch.int32 or packed.shape[1] != -(-k // (32 // bits)):
        raise ValueError(f"packed weights must be int32 [{n}, {-(-k // (32 // bits))}], "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    groups = k // group_size if group_size else 1
    for name, t in (("scale", scale), ("zero", zero)):
        if t is not None and tuple(t.shape) != (n, groups):
            raise ValueError(f"{name} must be [{n}, {groups}] for N={n}, K={k}, group {group_size}, "
                             f"got {tuple(t.shape)}")
    if config.block_k % (32 // bits) or min(config.block_m, config.block_n, config.block_k) < 16:
        raise ValueError(f"config {config}: tiles must be >= 16 (tl.dot) and BLOCK_K a multiple of "
                         f"{32 // bits} (whole int32 words)")
    x, scale = x.contiguous(), scale.contiguous()
    zero = None if zero is None else zero.contiguous()
    steps = triton.cdiv(k, config.block_k)
    k_per_split = triton.cdiv(steps, config.split_k) * config.block_k
    split = config.split_k > 1
    out = torch.empty((config.split_k, m, n) if split else (m, n), device=x.device,
                      dtype=torch.float32 if split else x.dtype)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    _mixed_gemm_kernel[grid](
        x, packed, scale, zero if zero is not None else scale, out, m, n, k, packed.shape[1], group_size or k,
        k_per_split,
        x.stride(0), packed.stride(0), scale.stride(0), n, m * n,
        BITS=bits, HAS_ZERO=zero is not None, SPLIT=split, DOT_F32=interpreting() or x.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out.sum(0).to(x.dtype) if split else out
