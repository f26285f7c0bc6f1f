"""W8A8: per-token INT8 activation quantization fused into one pass, then INT8 x INT8 -> INT32.

The activation grid is the runtime's (and compressed-tensors'): scale = max|x| / 127.5 per
row, values rounded half to even and clamped to [-128, 127]. The GEMM accumulates exactly
in int32 and applies the row and column scales once, in fp32, in its epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantpipe.kernels.common import round_half_even
from quantpipe.kernels.configs import GemmConfig


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / 127.5, 1e-10)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(round_half_even(x / scale), -128.0), 127.0)
        tl.store(q_ptr + row * stride_q + offs, q.to(tl.int8), mask=offs < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _int8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0)
        acc += tl.dot(a, tl.trans(w))
    a_scale = tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)
    w_scale = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def quantize_per_token(x: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M])."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    _quantize_per_token_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block)
    return q, s


def w8a8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, config: GemmConfig
              ) -> torch.Tensor:
    """x [M, K] quantized per token, times int8 weight [N, K] with per-channel scales -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != torch.int8 or weight.shape[1] != k:
        raise ValueError(f"W8A8 weights must be int8 [N, {k}], got {weight.dtype} {tuple(weight.shape)}")
    if config.split_k != 1:
        raise ValueError("the INT8 GEMM has no split-K variant (config split_k must be 1)")
    xq, xs = quantize_per_token(x)
    ws = weight_scale.reshape(-1).float().contiguous()
    if ws.numel() != n:
        raise ValueError(f"W8A8 weight_scale must hold one scale per output channel ({n}), got {ws.numel()}")
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _int8_gemm_kernel[grid](xq, xs, weight.contiguous(), ws, out, m, n, k, xq.stride(0), k, n,
                            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                            num_warps=config.num_warps, num_stages=config.num_stages)
    return out
