"""Wide float32 Linear layers on CPU, computed in row blocks of the weight when few rows come in.

On CPU, MKL's float32 GEMM is slow for a wide output at a few input rows. Measured on a
2-core AVX2 machine (BENCHMARKS.md, "Against vLLM's CPU backend"): lm_head (49,152 x 576)
at 16 rows takes 57 ms as one GEMM and 25 ms as 32 GEMMs over 1,536-row blocks of the
weight. A decode step with 16 requests running took 17% less time (252 ms against 304).

With many rows (prefill) the single GEMM is faster again, so blocks are used only up to
`MAX_ROWS`. Each block is a view of the weight: no copy, and tied weights stay tied.
Only float32 is blocked. bf16 GEMMs go through oneDNN, where this was not measured.
The `blocked-gemm` CPU kernel switch (cpu_kernels.py) turns it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCK_ROWS = 1536
MAX_ROWS = 256


class RowBlockedLinear(nn.Module):
    """Same parameters and output as the nn.Linear it replaces."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > MAX_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        out = torch.cat([F.linear(x, w) for w in self.weight.split(BLOCK_ROWS)], dim=-1)
        return out if self.bias is None else out + self.bias


def block_wide_linears(model: nn.Module, device: torch.device) -> list[str]:
    """Swap float32 nn.Linear layers wider than BLOCK_ROWS for RowBlockedLinear on CPU; returns their names."""
    if device.type != "cpu":
        return []
    names = [name for name, m in model.named_modules()
             if type(m) is nn.Linear and m.out_features > BLOCK_ROWS and m.weight.dtype == torch.float32]
    for name in names:
        model.set_submodule(name, RowBlockedLinear(model.get_submodule(name)))
    return names
