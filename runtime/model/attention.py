"""Paged attention: K/V live in fixed-size blocks addressed through block tables.

The cache of one layer holds slots `[num_blocks * block_size, kv_heads, head_dim]`
(slot = block_id * block_size + offset) in the model dtype or 8-bit (kv_cache.py). New
K/V are written into their slots, then each query reads only its own request's slots.
A cache that stores K/V in a rotated basis (`cache.rotation`, dynamic INT8) gets q, k
and v in that basis and the output is turned back: attention itself is unchanged.
Decodes (one query token) take the runner's `decode_kernel` when it has one (CPU:
csrc/paged_decode.cpp for caches in the model dtype or dynamic INT8; CUDA: quantpipe.kernels' Triton
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
    # Sliding-window masks of this step, built by the first local layer and read by the others:
    # ("decode" | "prefill", index, window) -> mask, or None where the window cuts nothing.
    window_masks: dict = field(default_factory=dict)


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


def _causal_band(q_pos: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """[len(q_pos), num_keys] True where key position j is at most q_pos and within its window."""
    j = torch.arange(num_keys, device=q_pos.device).unsqueeze(0)
    p = q_pos.unsqueeze(1)
    return (j <= p) & (j > p - window)


def _decode_window_mask(meta: AttentionMetadata, i: int, window: int) -> torch.Tensor | None:
    """Decode group i's [B, 1, 1, L] mask under the window; None when every context fits in it."""
    key = ("decode", i, window)
    if key not in meta.window_masks:
        g = meta.decodes[i]
        mask = None
        if int(g.context_lens.max()) > window:
            lens = g.context_lens.unsqueeze(1)
            mask = _causal_band(lens - 1, g.block_table.shape[1] * meta.block_size, window)[:, None, None, :]
        meta.window_masks[key] = mask
    return meta.window_masks[key]


def _prefill_window_mask(meta: AttentionMetadata, i: int, window: int) -> torch.Tensor | None:
    """Prefill span i's mask under the window (its queries are the last q_len of its ctx_len
    positions); None when its context fits in the window."""
    key = ("prefill", i, window)
    if key not in meta.window_masks:
        span = meta.prefills[i]
        mask = None
        if span.ctx_len > window:
            q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=meta.slot_mapping.device)
            if span.block_table is None:  # keys are the span's own tokens
                mask = _causal_band(q_pos, span.q_len, window)
            else:
                mask = span.mask & _causal_band(q_pos, span.mask.shape[-1], window)
        meta.window_masks[key] = mask
    return meta.window_masks[key]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    cache: KVCache | QuantizedKVCache,
    meta: AttentionMetadata,
    window: int | None = None,
) -> torch.Tensor:
    rot = cache.rotation
    if rot is not None:
        q, k, v = (_rotate(x, rot) for x in (q, k, v))
    out = _attend(q, k, v, cache, meta, window)
    return out if rot is None else _rotate(out, rot.mT)


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., D] times r [D, D], in float32, back in x's dtype."""
    return (x.float() @ r).to(x.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | QuantizedKVCache,
            meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    k, v = cache.write(meta.slot_mapping, k, v)  # as a read returns them: 8-bit caches round them
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for i, g in enumerate(meta.decodes):
        rows = slice(g.q_start, g.q_start + g.count)
        band = _decode_window_mask(meta, i, window) if window is not None else None
        if meta.decode_kernel is not None and band is None:
            out[rows] = meta.decode_kernel(q[rows], cache, g.block_table, g.context_lens, meta.block_size)
            continue
        kd, vd = cache.gather(g.block_table, meta.block_size)  # [B, L, KVH, D]
        out[rows] = _decode_attention(q[rows], kd, vd, g.mask if band is None else band)
    for i, span in enumerate(meta.prefills):
        rows = slice(span.q_start, span.q_start + span.q_len)
        # 4-D inputs: with 3-D ones CPU SDPA falls back to its slow math kernel.
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        band = _prefill_window_mask(meta, i, window) if window is not None else None
        if span.block_table is None:
            kp, vp = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
            if band is None:
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=gqa)
            else:
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=band, enable_gqa=gqa)
        else:
            kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in cache.gather(span.block_table, meta.block_size))
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask if band is None else band,
                                                enable_gqa=gqa)
        out[rows] = op[0].transpose(0, 1)
    return out
