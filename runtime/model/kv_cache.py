"""Paged KV cache storage: K and V in the model dtype, or 8-bit with a scale per token and KV head.

A cache holds one layer's slots `[num_slots, kv_heads, head_dim]` (slot = block_id *
block_size + offset). Attention writes each new token's K/V into its slot and reads
whole blocks back through a block table: `write` (which returns the K/V as a read will
see them) and `gather` are the whole storage interface, plus `rotation`, below.

- `auto`: the model dtype, stored as computed.
- `int8`: symmetric, x = q * scale, one fp16 scale (amax / 127) per token and KV head
  (66 bytes per head of 64 values instead of 128 in bf16: 1.94x the tokens), on K/V
  rotated per head by a normalized Hadamard matrix (`rotation`; head sizes that are
  powers of two). The rotation spreads the few large channels of rotated keys over
  all 64, so one scale per token fits every channel: on the default model it has half
  the KL of the asymmetric grid with a zero per token it replaced (68 bytes; BENCHMARKS.md,
  "KV cache in 8 bits").
- `fp8`: e4m3 with one fp16 scale per token and KV head (amax / 448), no zero.
- Either with static scales instead, calibrated when the artifact was made (symmetric;
  per KV head and channel, per head, or per layer), so only the values are stored (2x
  the tokens of bf16) and nothing is computed per token.

`rotation` ([D, D] orthonormal, or None) is the basis K and V are stored in. Attention
(attention.paged_attention) hands the cache q, k and v times it and multiplies its
output by the transpose: scores q.k and the mix of values are unchanged by an
orthonormal basis change, so every attention path (gather, SDPA, decode kernels) runs
as it is, in the rotated basis, at two D x D products per head and token (SpinQuant's
online Hadamard on queries and keys, applied to values too). It is the runtime's own
layout of a dynamic cache, which stores nothing an artifact describes.

Quantized caches are written on store and dequantized on read; the keys a prefill
chunk computes itself are taken as `write` returns them, so every key
attention sees went through the cache format whether or not it was chunked, and
teacher-forced scoring measures exactly what serving computes. One caveat: float32 K/V
differ in their last bits between batch shapes, and rounding to 8 bits can turn that
into one grid step, so greedy output may flip between batch compositions where the
top two tokens are nearly tied (the scorer scores each text alone, so evals are not
affected).
"""

from __future__ import annotations

import functools
import math

import torch

from quantpipe.formats.artifact import sylvester_hadamard

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-7  # smallest scale kept: a constant row quantizes to its zero, not to inf/nan


def check_kv_cache_dtype(value: str) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {value!r}")
    return value


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str,
                    static: bool = False) -> int:
    """Bytes one token occupies in the caches of all layers (K and V, scales included)."""
    if kv_cache_dtype == "auto":
        per_head = head_dim * torch.empty((), dtype=dtype).element_size()
    elif static:
        per_head = head_dim
    else:
        per_head = head_dim + 2  # values, fp16 scale
    return 2 * num_layers * kv_heads * per_head


@functools.cache
def hadamard(n: int) -> torch.Tensor | None:
    """The normalized Sylvester Hadamard matrix [n, n] (symmetric, orthonormal), float32;
    None where n is not a power of two. Built once per size and shared (never written to):
    every layer's cache, and every scratch cache a scoring pass makes, takes the same one."""
    if n < 1 or n & (n - 1):
        return None
    return sylvester_hadamard(n) / math.sqrt(n)


class KVCache:
    """K/V in the model dtype."""

    rotation: torch.Tensor | None = None  # stored as computed

    def __init__(self, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (num_slots, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store K/V into `slots`; returns them as a read will (here: unchanged, no copy)."""
        self.k.index_copy_(0, slots, k)
        self.v.index_copy_(0, slots, v)
        return k, v

    def gather(self, block_table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., num_blocks] block ids -> K and V [..., num_blocks * block_size, KVH, D]."""
        return _gather(self.k, block_table, block_size), _gather(self.v, block_table, block_size)


class QuantizedKVCache:
    """K/V as int8 or fp8 values with an fp16 scale per token and KV head (int8 in a
    Hadamard-rotated basis), or with `static` scales for K and V ([KVH, 1] or [KVH, D] each)."""

    def __init__(self, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, kind: str,
                 static: tuple[torch.Tensor, torch.Tensor] | None = None):
        if kind not in ("int8", "fp8"):
            raise ValueError(f"quantized KV cache kind must be int8 or fp8, got {kind!r}")
        self.kind, self.dtype = kind, dtype
        # fp8 values are kept as their raw bytes: CPU index_copy_/index_select lack float8 kernels.
        store = torch.int8 if kind == "int8" else torch.uint8
        self.q = [torch.zeros((num_slots, kv_heads, head_dim), dtype=store, device=device) for _ in "kv"]
        # [KVH, 1] (a scale per head) or [KVH, D] (per head and channel), broadcast over tokens
        self.static = None if static is None else [s.float().to(device).reshape(kv_heads, -1) for s in static]
        if self.static is None:
            self.scale = [torch.zeros((num_slots, kv_heads), dtype=torch.float16, device=device) for _ in "kv"]
        # Static scales were calibrated on K/V as computed, so only dynamic int8 stores them rotated.
        rot = hadamard(head_dim) if kind == "int8" and static is None else None
        self.rotation = None if rot is None else rot.to(device)

    def _quantize(self, x: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values, the fp16 scale per token and KV head or None with static scales)."""
        xf = x.float()
        grid_max = 127.0 if self.kind == "int8" else _FP8_MAX
        if self.static is not None:  # symmetric on the calibrated grid; values past it saturate
            scale, s = None, self.static[i]
        else:  # round with the stored (fp16) scale so the read inverts exactly this step
            scale = (xf.abs().amax(-1) / grid_max).clamp_min(SCALE_FLOOR).half()
            s = scale.float()[..., None]
        y = (xf / s).clamp_(-grid_max, grid_max)
        q = torch.round(y).to(torch.int8) if self.kind == "int8" else y.to(torch.float8_e4m3fn).view(torch.uint8)
        return q, scale

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor | None, i: int) -> torch.Tensor:
        x = q.float() if self.kind == "int8" else q.view(torch.float8_e4m3fn).float()
        return (x * (self.static[i] if scale is None else scale.float()[..., None])).to(self.dtype)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store K/V into `slots`; returns them dequantized, as a read will."""
        seen = []
        for i, x in enumerate((k, v)):
            q, scale = self._quantize(x, i)
            self.q[i].index_copy_(0, slots, q)
            if scale is not None:
                self.scale[i].index_copy_(0, slots, scale)
            seen.append(self._dequantize(q, scale, i))
        return seen[0], seen[1]

    def gather(self, block_table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for i in range(2):
            q = _gather(self.q[i], block_table, block_size)
            scale = None if self.static is not None else _gather(self.scale[i], block_table, block_size)
            out.append(self._dequantize(q, scale, i))
        return out[0], out[1]


def make_kv_cache(num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                  kv_cache_dtype: str = "auto", static: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> KVCache | QuantizedKVCache:
    if check_kv_cache_dtype(kv_cache_dtype) == "auto":
        return KVCache(num_slots, kv_heads, head_dim, dtype, device)
    return QuantizedKVCache(num_slots, kv_heads, head_dim, dtype, device, kv_cache_dtype, static)


def layer_cache(model, layer: int, num_slots: int, device, dtype: torch.dtype | None = None
                ) -> KVCache | QuantizedKVCache:
    """A cache in the format `model` is served with, for layer `layer` (static scales are per layer);
    `dtype`: K/V in this dtype instead of the model's (for a copy of the layer converted to it)."""
    cfg = model.config
    return make_kv_cache(num_slots, cfg.num_kv_heads, cfg.head_dim, dtype or model.embed_tokens.weight.dtype, device,
                         model.kv_cache_dtype, model.layers[layer].self_attn.kv_scales)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, *cache.shape[1:]].

    Whole blocks are copied as contiguous rows with index_select, much faster on CPU
    than gathering token by token or advanced indexing.
    """
    row = block_size * cache[0].numel()
    rows = cache.view(-1, row).index_select(0, block_table.flatten())
    return rows.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, *cache.shape[1:])
