"""Static KV cache scales: one per layer, KV head and channel, from the calibration set.

Each calibration sequence runs through the model with a recording cache in place of
the scratch one, so the K (after RoPE) and V that attention would store are seen
exactly; a scale is the largest magnitude seen over the grid's largest value (127 for
int8, 448 for fp8 e4m3). Values past it at serve time saturate. Per channel rather
than per head because rotated keys have a few channels far larger than the rest: on
the default model a scale per head adds about 3.5x the KL that one per channel
adds (BENCHMARKS.md).
"""

from __future__ import annotations

import torch

from quantpipe.runtime.model.forward import SequencePass
from quantpipe.runtime.model.kv_cache import KVCache

GRID_MAX = {"int8": 127.0, "fp8": 448.0}


class _AmaxRecorder(KVCache):
    def __init__(self, amax: list[torch.Tensor], num_slots: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__(num_slots, kv_heads, head_dim, dtype, device)
        self.amax = amax

    def write(self, slots, k, v):
        for i, x in enumerate((k, v)):
            torch.maximum(self.amax[i], x.detach().abs().float().amax(dim=0), out=self.amax[i])
        return super().write(slots, k, v)


@torch.inference_mode()
def static_kv_scales(model, samples: list[list[int]], kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(k_scale, v_scale)] per layer, each [KVH, head_dim] float32."""
    cfg = model.config
    amax = [[torch.zeros(cfg.num_kv_heads, cfg.head_dim) for _ in "kv"] for _ in model.layers]
    dtype = model.embed_tokens.weight.dtype
    for ids in samples:
        run = SequencePass(model, ids)
        x = run.embed()
        for i in range(len(model.layers)):
            x = run.layer(i, x, _AmaxRecorder(amax[i], len(ids), cfg.num_kv_heads, cfg.head_dim, dtype, x.device))
    return [tuple((a / GRID_MAX[kind]).clamp_min(1e-6) for a in pair) for pair in amax]
