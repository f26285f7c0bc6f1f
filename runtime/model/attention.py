"""Paged attention: K/V live in fixed-size blocks addressed through block tables.

The cache of one layer holds slots `[num_blocks * block_size, kv_heads, head_dim]`
(slot = block_id * block_size + offset) in the model dtype or 8-bit (kv_cache.py). New
K/V are written into their slots, then each query reads only its own request's slots.
Decodes (one query token) take the runner's `decode_kernel` when it has one (CPU:
csrc/paged_decode.cpp for caches in the model dtype; CUDA: quantpipe.kernels' Triton
kernel, INT8 too), which reads K/V straight from the blocks. Otherwise they are sorted by
context length into a few groups over padded slot tables (grouping similar lengths keeps
padding small), each gathered and attended with two GEMMs. Prefill chunks run one SDPA
call each.

A sliding-window layer (`window`: Gemma 3's local layers) lets a query at position p see
only keys at positions p - window + 1 .. p. Prefill spans that reach past the window get
that band as their mask; decodes whose context is longer than the window take the gather
path with the band masked (the decode kernels attend to the whole context).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantpipe.runtime.model.kv_cache import KVCache, QuantizedKVCache


@dataclass
class PrefillSpan:
    q_start: int  # first row in the flattened batch
    q_len: int
    ctx_len: int  # keys visible to the last query of the span
    block_table: torch.Tensor | None  # [num_blocks] blocks to read; None when nothing is cached before it
    mask: torch.Tensor | None = None  # [q_len, num_blocks * block_size] causal, offset by the cached prefix


@dataclass
class DecodeGroup:
    """Single-token queries of similar context length, attended in one padded call."""

    q_start: int
    count: int
    block_table: torch.Tensor  # [count, max_blocks]
    mask: torch.Tensor | None  # [count, 1, 1, max_blocks * block_size], True where attended (torch path)
    context_lens: torch.Tensor  # [count] keys each query attends to


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    block_size: int
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # (q [B, H, D], cache, block_table, context_lens, block_size) -> [B, H, D]; None: gather + GEMMs
    decode_kernel: Callable | None = None


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per sequence: q [B, H, D] over k, v [B, L, KVH, D], mask [B, 1, 1, L] -> [B, H, D].

    Two batched GEMMs and a softmax, not SDPA: CPU SDPA (its flash kernel) took 27 ms for
    64 queries over 640 keys where this takes 5 (benchmarks/profile_step.py, BENCHMARKS.md).
    The query heads sharing a KV head are the GEMM's rows, so K/V are never repeated for GQA.
    Scores and softmax are float32 (K is upcast as it is laid out for the GEMM); the
    probabilities are rounded to V's dtype for the second GEMM, as flash kernels do.
    """
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d).float() * d ** -0.5
    kt = k.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)  # [B, KVH, L, D]
    scores = torch.matmul(qg, kt.transpose(-1, -2))  # [B, KVH, G, L]
    scores.masked_fill_(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).reshape(b, h, d).to(q.dtype)


def _window_band(q_pos: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """[len(q_pos), num_keys] True where key position j is inside the window of the query at q_pos."""
    j = torch.arange(num_keys, device=q_pos.device).unsqueeze(0)
    return j > q_pos.unsqueeze(1) - window


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    cache: KVCache | QuantizedKVCache,
    meta: AttentionMetadata,
    window: int | None = None,
) -> torch.Tensor:
    k, v = cache.write(meta.slot_mapping, k, v)  # as a read returns them: 8-bit caches round them
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for g in meta.decodes:
        rows = slice(g.q_start, g.q_start + g.count)
        windowed = window is not None and int(g.context_lens.max()) > window
        if meta.decode_kernel is not None and not windowed:
            out[rows] = meta.decode_kernel(q[rows], cache, g.block_table, g.context_lens, meta.block_size)
            continue
        kd, vd = cache.gather(g.block_table, meta.block_size)  # [B, L, KVH, D]
        mask = g.mask
        if mask is None or windowed:  # the kernel path builds no mask; the window narrows it
            keys = torch.arange(kd.shape[1], device=q.device).unsqueeze(0)
            lens = g.context_lens.unsqueeze(1)
            mask = (keys < lens) & (keys >= lens - window if windowed else True)
            mask = mask[:, None, None, :]
        out[rows] = _decode_attention(q[rows], kd, vd, mask)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        # 4-D inputs: with 3-D ones CPU SDPA falls back to its slow math kernel.
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        windowed = window is not None and span.ctx_len > window
        if span.block_table is None:
            kp, vp = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
            if windowed:
                q_pos = torch.arange(span.q_len, device=q.device)
                band = _window_band(q_pos, span.q_len, window) & torch.ones(
                    span.q_len, span.q_len, dtype=torch.bool, device=q.device).tril()
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=band, enable_gqa=gqa)
            else:
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=gqa)
        else:
            kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in cache.gather(span.block_table, meta.block_size))
            mask = span.mask
            if windowed:  # the span's queries are the last q_len positions of its ctx_len
                q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=q.device)
                mask = mask & _window_band(q_pos, mask.shape[-1], window)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=gqa)
        out[rows] = op[0].transpose(0, 1)
    return out
