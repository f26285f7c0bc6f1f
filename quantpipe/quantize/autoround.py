"""AutoRound (Cheng et al., 2023): rounding learned block by block.

Each quantized Linear of a decoder layer gets a rounding offset v in [-0.5, 0.5] per
weight and two range factors in [0.5, 1] per output row and group, one for each end of
the group's range (a symmetric grid uses the full signed range: `LearnedGrid`). They start
at round-to-nearest on the group's whole range (v = 0, factors 1) and are learned
together by sign-gradient descent on the layer's output error: the layer with its
current quantized weights, fed the quantized model's activations, against the unquantized layer's output on the unquantized model's
activations, as a mean squared difference over a mini-batch of calibration sequences.
Rounding passes gradients straight through, and so does the rounding of each scale to the
dtype the artifact stores it in: what is learned is the stored grid. The step size decays
linearly to 0, and the step with the least mini-batch loss is kept, as auto-round does.

Only the rounding and each group's range are learned, so the artifact is an ordinary
integer grid: any kernel that reads RTN or GPTQ artifacts reads this one.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from quantpipe.formats.artifact import QuantWeight
from quantpipe.quantize.rtn import WeightScheme
from quantpipe.runtime.model.forward import SequenceBatch

FACTOR_MIN = 0.5  # the narrowest range a group may learn, as a share of its min-max range


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (straight-through)."""
    return x + (torch.round(x) - x).detach()


class LearnedGrid:
    """One Linear's learnable rounding: offsets v [N, K] and two range factors [N, G], one
    for each end of a group's range, as auto-round learns them.

    A symmetric grid uses the full signed range, as auto-round's does: the group's larger
    magnitude (after its factor) maps to q = -8 (for 4 bits) and the scale carries its sign,
    so all 16 levels are in use, at a step of max|w| / 8 where min-max RTN's is
    max|w| / 7.5. Dequantization is q * scale either way: compressed-tensors' symmetric
    format, read by its library, vLLM and quantpipe's runtime alike."""

    def __init__(self, w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype):
        n, k = w.shape
        self.gs = scheme.group_size or k
        self.scheme = scheme
        # The dtype the artifact stores scales in, one for learning and the result: learning
        # sees the scale rounded to it, or the codes recomputed against the stored scale undo
        # some of what was learned (auto-round casts its scale to its scale_dtype in every step).
        self.scale_dtype = scale_dtype
        self.w = w.detach().float().reshape(n, k // self.gs, self.gs)
        self.v = torch.zeros_like(self.w, requires_grad=True)
        self.hi = torch.ones(n, k // self.gs, requires_grad=True)
        self.lo = torch.ones(n, k // self.gs, requires_grad=True)

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.v, self.hi, self.lo]

    def _grid(self):
        """(scale [N, G, 1], zero [N, G, 1] or None) with the learned factors, the scale rounded
        as the artifact stores it (gradients pass the rounding straight)."""
        s = self.scheme
        lo_v = (self.w.amin(-1) * self.lo).clamp(max=0)
        hi_v = (self.w.amax(-1) * self.hi).clamp(min=0)
        if s.symmetric:  # the larger end onto q_min, the scale signed accordingly
            scale = torch.where(-lo_v >= hi_v, -lo_v, -hi_v) / -s.q_min
            scale = torch.where(scale < 0, scale.clamp(max=-1e-10), scale.clamp(min=1e-10))
        else:
            scale = ((hi_v - lo_v) / (s.q_max - s.q_min)).clamp(min=1e-10)
        scale = scale + (scale.to(self.scale_dtype).float() - scale).detach()
        zero = None
        if not s.symmetric:
            zero = (s.q_min - _round_ste(lo_v / scale)).clamp(s.q_min, s.q_max).unsqueeze(-1)
        return scale.unsqueeze(-1), zero

    def _codes(self, scale: torch.Tensor, zero: torch.Tensor | None, rounding) -> torch.Tensor:
        """q [N, G, gs] (float) on the grid, rounded with the learned offsets."""
        x = rounding(self.w / scale + self.v)
        return (x if zero is None else x + zero).clamp(self.scheme.q_min, self.scheme.q_max)

    def weight(self) -> torch.Tensor:
        """The fake-quantized weight [N, K], differentiable in v and the factors."""
        scale, zero = self._grid()
        q = self._codes(scale, zero, _round_ste)
        return ((q if zero is None else q - zero) * scale).reshape(self.w.shape[0], -1)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One sign-gradient step, then each parameter back into its range."""
        for p in self.params:
            if p.grad is not None:
                p.sub_(lr * p.grad.sign())
                p.grad = None
        self.v.clamp_(-0.5, 0.5)
        for f in (self.hi, self.lo):
            f.clamp_(FACTOR_MIN, 1.0)

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def load(self, values: list[torch.Tensor]) -> None:
        for p, v in zip(self.params, values):
            p.copy_(v)

    @torch.no_grad()
    def quantized(self) -> QuantWeight:
        """The integer grid: the scale as the artifact stores it, q rounded with the learned offsets."""
        scale, zero = self._grid()
        q = self._codes(scale, zero, torch.round).to(torch.int8).reshape(self.w.shape[0], -1)
        return QuantWeight(q, scale.squeeze(-1), None if zero is None else zero.squeeze(-1),
                           self.scheme.num_bits, self.scheme.group_size)


@contextmanager
def _weights(mods: dict[str, torch.nn.Module], tensors: dict[str, torch.Tensor]):
    """The Linears compute with `tensors` as their weights inside the block; restored after."""
    kept = {n: mods[n]._parameters.pop("weight") for n in tensors}
    try:
        for n, t in tensors.items():
            mods[n].weight = t
        yield
    finally:
        for n, p in kept.items():
            del mods[n].weight
            mods[n].weight = p


@dataclass
class LayerResult:
    weights: dict[str, QuantWeight]
    # The layer's output error over every calibration sequence at round-to-nearest and at the
    # learned rounding (float32), the step whose parameters were kept, the learning dtype.
    report: dict


def round_layer(model, i: int, schemes: dict[str, WeightScheme], seqs: list[list[int]], xs: list[torch.Tensor],
                ys: list[torch.Tensor], iters: int, batch_size: int, scale_dtype: torch.dtype,
                learn_dtype: torch.dtype = torch.float32, seed: int = 0) -> LayerResult:
    """Learn the rounding of decoder layer i's Linears named in `schemes` (local names).

    `xs[j]` is sequence j's input to the layer in the quantized model, `ys[j]` the
    unquantized model's output, the target (float32 [tokens, hidden]). Each step draws
    `batch_size` sequences (seeded) and runs them as one flat pass; the step size is
    1 / iters, decaying linearly to 0 (auto-round's defaults). `learn_dtype` bfloat16 runs
    the steps on a bfloat16 copy of the layer (the parameters stay float32, as auto-round's
    amp does); the errors that choose the result are float32. Should the learned rounding end
    with a larger error over all the sequences than round-to-nearest (it has not been seen
    to), round-to-nearest is kept and the report says so."""
    layer = model.layers[i]
    block = layer if learn_dtype == torch.float32 else copy.deepcopy(layer).to(learn_dtype)
    mods = {n: layer.get_submodule(n) for n in schemes}
    learn_mods = {n: block.get_submodule(n) for n in schemes}
    grids = {n: LearnedGrid(m.weight, schemes[n], scale_dtype) for n, m in mods.items()}

    def output(pick: list[int], module, mods_, tensors, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        batch = SequenceBatch(model, [seqs[j] for j in pick], dtype)
        with _weights(mods_, tensors):
            out = batch.layer(i, torch.cat([xs[j] for j in pick]).to(dtype), module).float()
        return out, torch.cat([ys[j] for j in pick])

    def error(weights: dict[str, QuantWeight]) -> float:
        total = 0.0
        with torch.no_grad():
            for a in range(0, len(seqs), batch_size):
                pick = list(range(a, min(a + batch_size, len(seqs))))
                out, y = output(pick, layer, mods, {n: qw.dequantize() for n, qw in weights.items()}, torch.float32)
                total += (out - y).pow(2).sum().item()
        return total / sum(y.numel() for y in ys)

    nearest = {n: g.quantized() for n, g in grids.items()}
    gen = torch.Generator().manual_seed(seed)
    lr = 1.0 / iters
    best_loss, best_step, best = float("inf"), -1, None
    for t in range(iters):
        pick = torch.randperm(len(seqs), generator=gen)[:batch_size].tolist()
        out, y = output(pick, block, learn_mods, {n: g.weight().to(learn_dtype) for n, g in grids.items()},
                        learn_dtype)
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        if loss.item() < best_loss:  # the loss of the parameters before this step
            best_loss, best_step, best = loss.item(), t, {n: g.snapshot() for n, g in grids.items()}
        for g in grids.values():
            g.step(lr * (1 - t / iters))
    if best is None:  # no step had a finite loss: nothing was learned
        learned, err_nearest = nearest, error(nearest)
        err_learned, kept = None, "nearest"
    else:
        for n, g in grids.items():
            g.load(best[n])
        learned = {n: g.quantized() for n, g in grids.items()}
        err_nearest, err_learned = error(nearest), error(learned)
        kept = "learned" if err_learned <= err_nearest else "nearest"
    report = {"error_nearest": err_nearest, "error_learned": err_learned, "best_step": best_step, "kept": kept,
              "learn_dtype": str(learn_dtype).removeprefix("torch.")}
    return LayerResult(learned if kept == "learned" else nearest, report)
