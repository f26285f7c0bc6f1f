"""Paged KV cache storage: K and V in the model dtype, or 8-bit with a scale per token and KV head.

A cache holds one layer's slots `[num_slots, kv_heads, head_dim]` (slot = block_id *
block_size + offset). Attention writes each new token's K/V into its slot and reads
whole blocks back through a block table, so the storage format is invisible to it:
`write` (which returns the K/V as a read will see them) and `gather` are the whole interface.

- `auto`: the model dtype, stored as computed.
- `int8`: asymmetric, x = (q + 128) * scale + zero, one fp16 scale and zero per token
  and KV head (68 bytes per head of 64 values instead of 128 in bf16).
- `fp8`: e4m3 with one fp16 scale per token and KV head (amax / 448), no zero.
- Either with static scales instead, calibrated when the artifact was made (symmetric;
  per KV head and channel, per head, or per layer), so only the values are stored (2x
  the tokens of bf16) and nothing is computed per token.

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

import torch

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
    elif kv_cache_dtype == "int8":
        per_head = head_dim + 2 + 2  # values, fp16 scale, fp16 zero
    else:
        per_head = head_dim + 2
    return 2 * num_layers * kv_heads * per_head


class KVCache:
    """K/V in the model dtype."""

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
    """K/V as int8 or fp8 values with an fp16 scale (and, for int8, zero) per token and KV head,
    or with `static` scales for K and V ([KVH, 1] or [KVH, D] each)."""

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
            self.zero = [torch.zeros((num_slots, kv_heads), dtype=torch.float16, device=device) for _ in "kv"] \
                if kind == "int8" else None

    def _quantize(self, x: torch.Tensor, i: int):
        xf = x.float()
        if self.static is not None:  # symmetric on the calibrated grid; values past it saturate
            s = self.static[i]
            if self.kind == "int8":
                return torch.round(xf / s).clamp_(-127, 127).to(torch.int8), None, None
            return (xf / s).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), None, None
        if self.kind == "int8":
            lo, hi = xf.amin(-1), xf.amax(-1)
            scale = ((hi - lo) / 255).clamp_min(SCALE_FLOOR).half()
            zero = lo.half()
            # Round with the stored (fp16) scale and zero so the read inverts exactly this step.
            q = torch.round((xf - zero.float()[..., None]) / scale.float().clamp_min(SCALE_FLOOR)[..., None])
            return (q.clamp_(0, 255) - 128).to(torch.int8), scale, zero
        scale = (xf.abs().amax(-1) / _FP8_MAX).clamp_min(SCALE_FLOOR).half()
        q = (xf / scale.float().clamp_min(SCALE_FLOOR)[..., None]).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8), scale, None

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                    i: int) -> torch.Tensor:
        if self.static is not None:
            x = q.float() if self.kind == "int8" else q.view(torch.float8_e4m3fn).float()
            return (x * self.static[i]).to(self.dtype)
        if self.kind == "int8":
            x = (q.float() + 128) * scale.float()[..., None] + zero.float()[..., None]
        else:
            x = q.view(torch.float8_e4m3fn).float() * scale.float()[..., None]
        return x.to(self.dtype)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store K/V into `slots`; returns them dequantized, as a read will."""
        seen = []
        for i, x in enumerate((k, v)):
            q, scale, zero = self._quantize(x, i)
            self.q[i].index_copy_(0, slots, q)
            if scale is not None:
                self.scale[i].index_copy_(0, slots, scale)
            if zero is not None:
                self.zero[i].index_copy_(0, slots, zero)
            seen.append(self._dequantize(q, scale, zero, i))
        return seen[0], seen[1]

    def gather(self, block_table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for i in range(2):
            q = _gather(self.q[i], block_table, block_size)
            if self.static is not None:
                out.append(self._dequantize(q, None, None, i))
                continue
            scale = _gather(self.scale[i], block_table, block_size)
            zero = None if self.zero is None else _gather(self.zero[i], block_table, block_size)
            out.append(self._dequantize(q, scale, zero, i))
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
