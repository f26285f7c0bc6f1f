"""bf16 Linear layers on CPU with their weights prepacked once for oneDNN.

`F.linear` on a plain bf16 weight reorders it into oneDNN's blocked layout on every call.
Packing it once at load (the reorder that torch's own compiler does when it freezes a
model) makes the same product 1.3-2x faster at decode sizes and about even at prefill
sizes. Measured on a 2-core AVX-512 BF16 CPU (BENCHMARKS.md, "Prepacked bf16 weights"):
gate_up (3,072 x 576) at 16 rows 121 -> 81 us, lm_head (49,152 x 576) at one row
3.3 -> 1.1 ms. The results are bit-identical to `F.linear`'s.

The packed tensor replaces the weight (no second copy), except for a `lm_head` tied to the
embeddings, whose packed copy comes on top of the embedding table it shares. `weight`
still reads back as the plain tensor, and the state dict holds it, for the code that
exports or inspects the model. Only CPUs with AVX-512 BF16 are packed: elsewhere bf16 is
emulated and `dtype="auto"` serves float32. The `prepack` CPU kernel switch (cpu_kernels.py) turns it off.
"""

from __future__ import annotations

import torch
from torch import nn

# The row count oneDNN is told to expect; any count runs on the packed weight (tested), and
# 1, 16 and 64 gave the same speeds at 1 to 512 rows.
ROWS_HINT = 16


class PrepackedLinear(nn.Module):
    """Same output as the bf16 nn.Linear it replaces, computed on a oneDNN-packed weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight (a copy unpacked on each access: not for the hot path)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)


def _cpu_has_avx512_bf16() -> bool:
    from quantpipe.runtime.model.cpu_attention import _cpu_flags

    return "avx512_bf16" in _cpu_flags().split()


def prepack_linears(model: nn.Module, device: torch.device) -> list[str]:
    """Swap bf16 nn.Linear layers for PrepackedLinear on AVX-512 BF16 CPUs; returns their names."""
    if device.type != "cpu" \
            or not torch.backends.mkldnn.is_available() or not _cpu_has_avx512_bf16():
        return []
    names = [name for name, m in model.named_modules()
             if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16]
    for name in names:
        model.set_submodule(name, PrepackedLinear(model.get_submodule(name)))
    return names
