"""Integer grids for weights: scales and zero points per group or per output channel, and
round-to-nearest onto them (RTN).

Conventions are compressed-tensors' (so its library and vLLM read our artifacts as we
mean them): b-bit signed values q in [-2^(b-1), 2^(b-1) - 1]; symmetric scale =
max|w| / ((q_max - q_min) / 2) with zero point 0; asymmetric scale = (max - min) /
(q_max - q_min) with an integer zero point; w ~ (q - zero) * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpipe.formats.artifact import QuantWeight


@dataclass(frozen=True)
class WeightScheme:
    num_bits: int  # 4 or 8
    group_size: int | None  # None: one scale per output channel
    symmetric: bool = True

    @property
    def q_min(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def q_max(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def groups(self, in_features: int) -> int:
        if self.group_size is None:
            return 1
        return in_features // self.group_size

    def bits_per_weight(self, scale_bits: int = 16) -> float:
        """Storage cost per weight, scales (and zero points) included."""
        per_group = scale_bits + (0 if self.symmetric else self.num_bits)
        return self.num_bits + (per_group / self.group_size if self.group_size else 0.0)

    def describe(self) -> str:
        g = f"g{self.group_size}" if self.group_size else "channel"
        return f"W{self.num_bits} {g} {'sym' if self.symmetric else 'asym'}"


def _grouped(w: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    n, k = w.shape
    gs = scheme.group_size or k
    if k % gs:
        raise ValueError(f"group_size {gs} does not divide the input size {k}")
    return w.reshape(n, k // gs, gs)


def group_ranges(w: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per output row and group [N, G]: (max |w|, None) when symmetric, else (min, max)."""
    g = _grouped(w.float(), scheme)
    if scheme.symmetric:
        return g.abs().amax(-1), None
    return g.amin(-1), g.amax(-1)


def grid(ranges: tuple[torch.Tensor, torch.Tensor | None], scheme: WeightScheme, shrink: torch.Tensor | float = 1.0):
    """(scale [N, G], zero [N, G] or None) from `group_ranges`; `shrink` clips the range."""
    span = scheme.q_max - scheme.q_min
    if scheme.symmetric:
        amax = ranges[0] * shrink
        scale = (amax / (span / 2)).clamp(min=1e-10)
        return scale, None
    lo = (ranges[0] * shrink).clamp(max=0)
    hi = (ranges[1] * shrink).clamp(min=0)
    scale = ((hi - lo) / span).clamp(min=1e-10)
    zero = (scheme.q_min - torch.round(lo / scale)).clamp(scheme.q_min, scheme.q_max)
    return scale, zero


def qparams(w: torch.Tensor, scheme: WeightScheme, shrink: torch.Tensor | float = 1.0):
    """(scale [N, G], zero [N, G] or None) for weight w [N, K]; `shrink` clips the range."""
    return grid(group_ranges(w, scheme), scheme, shrink)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: WeightScheme) -> torch.Tensor:
    """int8 q [N, K] of w on the grid (scale, zero)."""
    g = _grouped(w.float(), scheme)
    x = g / scale.unsqueeze(-1)
    if zero is not None:
        x = x + zero.unsqueeze(-1)
    return torch.round(x).clamp(scheme.q_min, scheme.q_max).to(torch.int8).reshape(w.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: WeightScheme) -> torch.Tensor:
    """float32 weights back from the grid: the runtime's own dequantization, one definition."""
    return QuantWeight(q, scale, zero, scheme.num_bits, scheme.group_size).dequantize()


def rtn(w: torch.Tensor, scheme: WeightScheme, clip: str = "minmax"):
    """Round-to-nearest: (q, scale, zero). clip='mse' searches a per-group range shrink that
    minimizes the rounding error (|err|^2.4, as llm-compressor's MSE observer does)."""
    if clip == "minmax":
        scale, zero = qparams(w, scheme)
        return quantize(w, scale, zero, scheme), scale, zero
    if clip != "mse":
        raise ValueError(f"clip must be 'minmax' or 'mse', got {clip!r}")
    g = _grouped(w.float(), scheme)
    best_err = torch.full(g.shape[:2], float("inf"))
    best_scale, best_zero = None, None
    for shrink in torch.linspace(1.0, 0.5, 21).tolist():
        scale, zero = qparams(w, scheme, shrink)
        q = quantize(w, scale, zero, scheme)
        err = (_grouped(dequantize(q, scale, zero, scheme), scheme) - g).abs().pow(2.4).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = scale if best_scale is None else torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = zero if best_zero is None else torch.where(better, zero, best_zero)
    return quantize(w, best_scale, best_zero, scheme), best_scale, best_zero
