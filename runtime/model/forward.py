"""One whole sequence through the runtime's own model code, outside the engine.

Calibration (GPTQ, AWQ, sensitivity) and teacher-forced scoring need every position's
hidden states or logits for a single text. They reuse the engine's model and attention
unchanged: a scratch KV cache of the sequence's length and one prefill span, so the
numbers are exactly the ones serving computes, and one sequence per call keeps them
independent of whatever else is scored (no batch-composition effects).
"""

from __future__ import annotations

import torch

from quantpipe.runtime.model.attention import AttentionMetadata, PrefillSpan
from quantpipe.runtime.model.llama import LlamaForCausalLM


class SequencePass:
    """Per-layer access to one sequence's forward pass (for layer-by-layer calibration)."""

    def __init__(self, model: LlamaForCausalLM, ids: list[int] | torch.Tensor):
        cfg = model.config
        p = next(model.parameters())
        self.model = model
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=p.device)
        n = len(self.ids)
        self.meta = AttentionMetadata(slot_mapping=torch.arange(n, device=p.device), block_size=1,
                                      prefills=[PrefillSpan(0, n, n, None)])
        dtype = model.embed_tokens.weight.dtype
        self.kv = torch.empty((2, n, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device=p.device)
        positions = torch.arange(n, device=p.device)
        self.cos, self.sin = model.rotary(positions, dtype)

    def embed(self) -> torch.Tensor:
        return self.model.embed_tokens(self.ids)

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.model.layers[i](x, self.cos, self.sin, (self.kv[0], self.kv[1]), self.meta)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.norm(x)).float()


@torch.inference_mode()
def sequence_logits(model: LlamaForCausalLM, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """float32 logits [T, V] for every position of `ids`."""
    run = SequencePass(model, ids)
    x = run.embed()
    for i in range(len(model.layers)):
        x = run.layer(i, x)
    return run.logits(x)
