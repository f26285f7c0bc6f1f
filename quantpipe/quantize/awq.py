"""AWQ: activation-aware weight quantization, layer by layer.

Per decoder layer, from the calibration activations that reach it (through the already
quantized layers before it):

1. **Scales.** For each Linear whose input can absorb a per-channel factor, weights are
   multiplied by s_j = m_j^alpha (m_j: channel j's RMS input magnitude, normalized so
   max * min = 1) and the producer of that input divided by s: the RMSNorm before
   q/k/v and before gate/up, the up projection before down, and v before o when every
   query head has its own KV head. The function is unchanged before rounding; after it,
   channels that carry large activations are rounded more finely. alpha is chosen on a
   grid by the output error.
2. **Clipping.** Per output row and group, the range shrink (1.0 down to 0.55) with the
   least output error.

"Output error" is ||X (W - Q(W))^T||^2 over the calibration tokens, computed as
sum((D H) * D) with H = X^T X / n, the same Hessian GPTQ builds, so no search step
runs the model again; for clipping, a group's error uses H's diagonal block.
"""

from __future__ import annotations

import torch

from quantpipe.quantize.rtn import WeightScheme, dequantize, grid, group_ranges, qparams, quantize
from quantpipe.runtime.model.llama import SparseMoE

ALPHAS = tuple(i / 20 for i in range(20))
SHRINKS = tuple(1 - 0.05 * i for i in range(10))


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per output row: ||X (w - w_hat)^T||^2 / n for inputs X with X^T X / n = h."""
    d = (w - w_hat).float()
    return ((d @ h) * d).sum(-1)


def fake_quant(w: torch.Tensor, scheme: WeightScheme, shrink=1.0) -> torch.Tensor:
    scale, zero = qparams(w, scheme, shrink)
    return dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme)


def search_scale(ws: list[torch.Tensor], hs: list[torch.Tensor], schemes: list[WeightScheme],
                 tokens: list[float] | None = None) -> tuple[torch.Tensor, float, float]:
    """(s [K], alpha, error(alpha) / error(0)): the input-channel scale with the least output
    error, shared by the Linears `ws` that read one input (one Linear, or every expert of a
    MoE layer). Each Linear's error is weighted by `tokens`, the calibration tokens its H
    averages over (an expert's share of the layer's traffic); the magnitudes are the
    token-weighted mean of the H diagonals. Linears with no tokens add no error."""
    tokens = tokens or [1.0] * len(ws)
    live = [(w, h, sch, n) for w, h, sch, n in zip(ws, hs, schemes, tokens) if n > 0]
    if not live:  # no Linear of the group saw a token: nothing to weigh a scale by
        return torch.ones(ws[0].shape[1]), 0.0, 1.0
    mag = (sum(n * h.diagonal() for _, h, _, n in live) / sum(n for *_, n in live)).clamp(min=0).sqrt()
    best, base = None, 0.0
    for alpha in ALPHAS:
        s = mag.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(n * output_error(w, fake_quant(w * s, sch) / s, h).sum().item() for w, h, sch, n in live)
        if best is None or err < best[0]:
            best = (err, s, alpha)
        if alpha == 0:
            base = err
    return best[1], best[2], best[0] / max(base, 1e-30)


def search_clip(w: torch.Tensor, h: torch.Tensor, scheme: WeightScheme,
                shrinks: tuple[float, ...] = SHRINKS) -> torch.Tensor:
    """Range shrink [N, G] per output row and group with the least output error of that group.

    Each candidate's rounding error is `w - fake_quant(w, scheme, r)` with fake_quant's own
    arithmetic, in one reused buffer: the group ranges are taken once, and no candidate
    allocates a weight-sized tensor (on a streamed run each such allocation is a fresh
    mapping the kernel zeroes)."""
    n, k = w.shape
    gs = scheme.group_size or k
    g = k // gs
    blocks = torch.stack([h[i * gs:(i + 1) * gs, i * gs:(i + 1) * gs] for i in range(g)])  # [G, gs, gs]
    grouped = w.float().reshape(n, g, gs)
    ranges = group_ranges(w, scheme)
    d = torch.empty_like(grouped)
    best_err = torch.full((n, g), float("inf"))
    best = torch.ones(n, g)
    for r in shrinks:
        # quantize and dequantize on the grid for shrink r, in place.
        scale, zero = grid(ranges, scheme, r)
        scale, zero = scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1)
        torch.div(grouped, scale, out=d)
        if zero is not None:
            d.add_(zero)
        d.round_().clamp_(scheme.q_min, scheme.q_max)
        if zero is not None:
            d.sub_(zero)
        d.mul_(scale)
        torch.sub(grouped, d, out=d)
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, r), best)
    return best


def quantize_clipped(w: torch.Tensor, h: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype):
    """(q, scale, zero) with the searched clipping; scales rounded to the artifact dtype first,
    so the stored scale is the one the values were rounded against."""
    shrink = search_clip(w, h, scheme)
    scale, zero = qparams(w, scheme, shrink)
    scale = scale.to(scale_dtype).float()
    return quantize(w, scale, zero, scheme), scale, zero


def moe_mlps(mlp) -> list:
    """The MLPs that read the norm's output: a dense layer's one, or a MoE layer's experts
    followed by its shared expert (if any)."""
    if not isinstance(mlp, SparseMoE):
        return [mlp]
    return list(mlp.experts) + ([mlp.shared_expert] if mlp.shared_expert is not None else [])


def fold_scales(layer, s_qkv=None, s_gate_up=None, s_down=None, s_o=None) -> None:
    """Multiply each Linear's input channels by its s and divide the producer of that input by s.

    In a MoE layer `s_gate_up` is shared: the norm before the MLP feeds the router and every
    expert, so the router's weight takes s too (its logits are unchanged; it stays in high
    precision), as does a shared expert's gate; `s_down` is a list with one scale per
    expert, the shared expert last (None: left as it is)."""
    attn, mlp = layer.self_attn, layer.mlp
    experts = moe_mlps(mlp)
    with torch.no_grad():
        if s_qkv is not None:
            layer.attn_in_norm.divide_(s_qkv)
            attn.qkv_proj.weight.mul_(s_qkv)
        if s_gate_up is not None:
            layer.mlp_in_norm.divide_(s_gate_up)
            if isinstance(mlp, SparseMoE):
                mlp.gate.weight.mul_(s_gate_up)
                if mlp.shared_expert_gate is not None:
                    mlp.shared_expert_gate.weight.mul_(s_gate_up)
            for e in experts:
                e.gate_up_proj.weight.mul_(s_gate_up)
        for e, s in zip(experts, s_down if isinstance(s_down, list) else [s_down]):
            if s is not None:
                inter = e.down_proj.in_features
                e.gate_up_proj.weight[inter:].div_(s[:, None])  # act(gate) * up: scale up's outputs
                e.down_proj.weight.mul_(s)
        if s_o is not None:  # attention output channel c is a mix of v's channel c
            v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
            attn.qkv_proj.weight[v_rows].div_(s_o[:, None])
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias[v_rows].div_(s_o)
            attn.o_proj.weight.mul_(s_o)


def scale_layer(layer, hessians: dict[str, torch.Tensor], schemes: dict[str, WeightScheme | None],
                tokens: dict[str, int] | None = None) -> dict:
    """Search and fold the scales of one decoder layer; returns {linear: alpha, error ratio}.

    `hessians` and `schemes` are keyed by the layer's module names (self_attn.qkv_proj,
    ...); hessians are transformed in place to the scaled inputs (H / s s^T). In a MoE
    layer the experts' gate/up projections (a shared expert's too) share one scale,
    searched over all of them with each expert's error weighted by `tokens` (the
    calibration tokens routed to it; every token for a shared expert), and each expert's
    down projection gets its own (AutoAWQ's grouping for Mixtral and Qwen2-MoE).
    """
    attn = layer.self_attn
    moe = isinstance(layer.mlp, SparseMoE)
    name_of = {id(m): n for n, m in layer.named_modules()}
    mlp_names = [name_of[id(m)] for m in moe_mlps(layer.mlp)]  # in fold_scales' order
    groups = {"s_qkv": ["self_attn.qkv_proj"], "s_gate_up": [f"{m}.gate_up_proj" for m in mlp_names]}
    groups.update({f"s_down.{k}": [f"{m}.down_proj"] for k, m in enumerate(mlp_names)})
    if attn.num_heads == attn.num_kv_heads:  # with GQA, o's input channels share v's: no single scale
        groups["s_o"] = ["self_attn.o_proj"]
    found, chosen = {}, {}
    for arg, names in groups.items():
        names = [n for n in names if schemes.get(n) is not None]
        if not names:
            continue
        s, alpha, ratio = search_scale([layer.get_submodule(n).weight.float() for n in names],
                                       [hessians[n] for n in names], [schemes[n] for n in names],
                                       [tokens.get(n, 0) for n in names] if moe and tokens else None)
        chosen[arg] = s
        for n in names:
            found[n] = {"alpha": alpha, "error_ratio": round(ratio, 4)}
            hessians[n] = hessians[n] / (s[:, None] * s[None, :])
    downs = [chosen.pop(f"s_down.{k}", None) for k in range(len(mlp_names))]
    fold_scales(layer, s_down=downs if moe else downs[0], **chosen)
    return found
