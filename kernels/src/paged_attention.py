"""Decode attention read straight from the paged KV cache, and the write path into it.

The cache is the runtime's (quantpipe.runtime.model.kv_cache): one layer's slots
[num_slots, KVH, D] (slot = block id * block size + offset), stored in the model dtype
(`auto`), or as INT8 with an fp16 scale per token and KV head (dynamic; K/V in the
cache's rotated basis, which the caller's q is already in), or as INT8 on static
per-(head, channel) scales. Each program takes one sequence and one query
head, walks the sequence's block table, dequantizes each K/V block as it loads it and
keeps an online softmax, so no gathered copy of the context is ever built.
"""

from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl

from quantpipe.kernels.common import round_half_even
from quantpipe.runtime.model.kv_cache import SCALE_FLOOR, KVCache, QuantizedKVCache

log = logging.getLogger("quantpipe.kernels")

AUTO, INT8_DYNAMIC, INT8_STATIC = 0, 1, 2


def kv_kind(cache: KVCache | QuantizedKVCache) -> int:
    """The kernel's code for this cache's storage format (fp8 has no kernel here: ValueError)."""
    if isinstance(cache, KVCache):
        return AUTO
    if cache.kind != "int8":
        raise ValueError(f"no paged attention kernel for a {cache.kind} KV cache (bf16 and int8 only)")
    return INT8_STATIC if cache.static is not None else INT8_DYNAMIC


@triton.jit
def _dequant(x, scale_ptr, slots, valid, kvh, offs_d, KVH, D: tl.constexpr, KIND: tl.constexpr):
    x = x.to(tl.float32)
    if KIND == 1:
        x = x * tl.load(scale_ptr + slots * KVH + kvh, mask=valid, other=0.0).to(tl.float32)[:, None]
    if KIND == 2:
        x = x * tl.load(scale_ptr + kvh * D + offs_d)[None, :]
    return x


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, out_ptr,
                         sm_scale, KVH, stride_qb, stride_table, stride_ob,
                         GQA: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GQA
    ctx = tl.load(lens_ptr + b)
    offs_t = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * D + offs_d).to(tl.float32) * sm_scale
    m_i = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
    acc = tl.zeros((D,), dtype=tl.float32)
    for j in range(0, tl.cdiv(ctx, BLOCK)):
        block = tl.load(table_ptr + b * stride_table + j).to(tl.int64)
        slots = block * BLOCK + offs_t
        valid = j * BLOCK + offs_t < ctx
        off = slots[:, None] * (KVH * D) + kvh * D + offs_d[None, :]
        k = _dequant(tl.load(k_ptr + off, mask=valid[:, None], other=0), ks_ptr, slots, valid, kvh, offs_d, KVH,
                     D, KIND)
        s = tl.where(valid, tl.sum(k * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = _dequant(tl.load(v_ptr + off, mask=valid[:, None], other=0), vs_ptr, slots, valid, kvh, offs_d, KVH,
                     D, KIND)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(out_ptr + b * stride_ob + h * D + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty))


def _storage(cache: KVCache | QuantizedKVCache, i: int):
    """(values, scales) tensors for K (i=0) or V (i=1); a cache without scales repeats the values."""
    kind = kv_kind(cache)
    if kind == AUTO:
        x = cache.k if i == 0 else cache.v
        return x, x
    if kind == INT8_STATIC:
        d = cache.q[i].shape[-1]
        return cache.q[i], cache.static[i].expand(-1, d).contiguous()
    return cache.q[i], cache.scale[i]


def paged_decode(q: torch.Tensor, cache: KVCache | QuantizedKVCache, block_table: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence, its K/V already written) -> attention output [B, H, D],
    both in the cache's basis (`cache.rotation`: attention.paged_attention turns them)."""
    b, h, d = q.shape
    kind = kv_kind(cache)
    values = cache.k if kind == AUTO else cache.q[0]
    kvh = values.shape[1]
    if h % kvh or d & (d - 1) or block_size & (block_size - 1):
        raise ValueError(f"paged decode needs heads ({h}) divisible by KV heads ({kvh}) and power-of-two "
                         f"head_dim ({d}) and block size ({block_size})")
    q = q.contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    (k, ks), (v, vs) = _storage(cache, 0), _storage(cache, 1)
    _paged_decode_kernel[(b, h)](q, k, v, ks, vs, table, lens, out, 1.0 / math.sqrt(d), kvh,
                                 q.stride(0), table.stride(0), out.stride(0),
                                 GQA=h // kvh, D=d, BLOCK=block_size, KIND=kind)
    return out


@triton.jit
def _kv_write_kernel(x_ptr, slots_ptr, q_ptr, s_ptr, KVH, stride_xt,
                     D: tl.constexpr, KIND: tl.constexpr, TINY: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, D)
    x = tl.load(x_ptr + t * stride_xt + h * D + offs_d).to(tl.float32)
    dst = q_ptr + slot * (KVH * D) + h * D + offs_d
    if KIND == 1:  # the runtime's grid: q * scale, the scale (amax / 127) rounded to fp16 first
        scale = tl.maximum(tl.max(tl.abs(x), 0) / 127.0, TINY).to(tl.float16)
        u = round_half_even(x / scale.to(tl.float32))
        tl.store(dst, tl.minimum(tl.maximum(u, -127.0), 127.0).to(tl.int8))
        tl.store(s_ptr + slot * KVH + h, scale)
    else:  # static symmetric scales per (head, channel)
        s = tl.load(s_ptr + h * D + offs_d)
        tl.store(dst, tl.minimum(tl.maximum(round_half_even(x / s), -127.0), 127.0).to(tl.int8))


def kv_write(cache: QuantizedKVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize new K/V [T, KVH, D], already in the cache's basis, into their slots of an INT8 cache, as
    QuantizedKVCache.write stores them."""
    kind = kv_kind(cache)
    if kind == AUTO:
        raise ValueError("kv_write quantizes into an int8 cache; a bf16 cache takes index_copy_")
    t, kvh, d = k.shape
    slots = slots.contiguous()
    for i, x in enumerate((k, v)):
        x = x.contiguous()
        values, scale = _storage(cache, i)
        _kv_write_kernel[(t, kvh)](x, slots, values, scale, kvh, x.stride(0), D=d, KIND=kind, TINY=SCALE_FLOOR)


def decode_kernel_for(model, block_size: int):
    """`paged_decode` when it has a case for this model's KV cache and block size, else None
    (said why): what the engine hands its runner on CUDA."""
    cfg = model.config
    reason = None
    if model.kv_cache_dtype == "fp8":
        reason = "an fp8 KV cache"
    elif cfg.head_dim & (cfg.head_dim - 1) or block_size & (block_size - 1):
        reason = f"head_dim {cfg.head_dim} / block_size {block_size} not powers of two"
    if reason:
        log.warning("decode attention uses gather + GEMMs: the Triton paged decode kernel has no case for %s", reason)
        return None
    return paged_decode
