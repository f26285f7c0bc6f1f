"""bf16 RMSNorm and SiLU-mul on CPU in one pass each (csrc/elementwise.cpp), swapped in at load.

torch computes each as five to seven separate element-wise ops over the whole activation;
at prefill sizes those ops took about a third of a step (BENCHMARKS.md, "Where prefill time
goes"). The fused versions round to bf16 where the composition in llama.py does, so they
differ from it only where a float32 sum in another order lands on the other side of a bf16
rounding boundary (tests/model/test_fused_elementwise.py). float32 models keep the torch
composition, which the parity tests hold equal to the reference's. The module is the CPU
paged decode kernel's (one build); the `fused-elementwise` CPU kernel switch (cpu_kernels.py) turns the swap off.
"""

from __future__ import annotations

import torch

from quantpipe.runtime.model.llama import MLP, LlamaForCausalLM, RMSNorm


class FusedRMSNorm(RMSNorm):
    ext = None  # the compiled module, set by fuse_elementwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.ext.rms_norm_bf16(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)


class FusedMLP(MLP):
    ext = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        shape = gate_up.shape
        h = self.ext.silu_mul_bf16(gate_up.reshape(-1, shape[-1]))
        return self.down_proj(h.view(*shape[:-1], shape[-1] // 2))


def fuse_elementwise(model: LlamaForCausalLM, device: torch.device) -> int:
    """Swap a bf16 CPU model's RMSNorm and MLP modules for the fused ones; returns how many."""
    if device.type != "cpu" \
            or model.embed_tokens.weight.dtype != torch.bfloat16:
        return 0
    from quantpipe.runtime.model.cpu_attention import extension

    ext = extension()
    if ext is None:
        return 0
    FusedRMSNorm.ext = FusedMLP.ext = ext
    swapped = 0
    for m in model.modules():
        # Same parameters and attributes: only the class (its forward) changes.
        if type(m) is RMSNorm and m.weight.dtype == torch.bfloat16:
            m.__class__ = FusedRMSNorm
            swapped += 1
        elif type(m) is MLP:
            m.__class__ = FusedMLP
            swapped += 1
    return swapped
