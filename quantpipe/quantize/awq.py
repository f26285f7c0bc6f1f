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

from quantpipe.quantize.rtn import WeightScheme, dequantize, qparams, quantize

ALPHAS = tuple(i / 20 for i in range(20))
SHRINKS = tuple(1 - 0.05 * i for i in range(10))


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per output row: ||X (w - w_hat)^T||^2 / n for inputs X with X^T X / n = h."""
    d = (w - w_hat).float()
    return ((d @ h) * d).sum(-1)


def fake_quant(w: torch.Tensor, scheme: WeightScheme, shrink=1.0) -> torch.Tensor:
    scale, zero = qparams(w, scheme, shrink)
    return dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme)


def search_scale(w: torch.Tensor, h: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, float, float]:
    """(s [K], alpha, error(alpha) / error(0)): the input-channel scale with the least output error."""
    mag = h.diagonal().clamp(min=0).sqrt()
    best = None
    for alpha in ALPHAS:
        s = mag.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(w, fake_quant(w * s, scheme) / s, h).sum().item()
        if best is None or err < best[0]:
            best = (err, s, alpha)
        if alpha == 0:
            base = err
    return best[1], best[2], best[0] / max(base, 1e-30)


def search_clip(w: torch.Tensor, h: torch.Tensor, scheme: WeightScheme,
                shrinks: tuple[float, ...] = SHRINKS) -> torch.Tensor:
    """Range shrink [N, G] per output row and group with the least output error of that group."""
    n, k = w.shape
    gs = scheme.group_size or k
    g = k // gs
    blocks = torch.stack([h[i * gs:(i + 1) * gs, i * gs:(i + 1) * gs] for i in range(g)])  # [G, gs, gs]
    best_err = torch.full((n, g), float("inf"))
    best = torch.ones(n, g)
    for r in shrinks:
        d = (w - fake_quant(w, scheme, r)).float().view(n, g, gs)
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


def fold_scales(layer, s_qkv=None, s_gate_up=None, s_down=None, s_o=None) -> None:
    """Multiply each Linear's input channels by its s and divide the producer of that input by s."""
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        if s_qkv is not None:
            layer.attn_in_norm.divide_(s_qkv)
            attn.qkv_proj.weight.mul_(s_qkv)
        if s_gate_up is not None:
            layer.mlp_in_norm.divide_(s_gate_up)
            mlp.gate_up_proj.weight.mul_(s_gate_up)
        if s_down is not None:
            inter = mlp.down_proj.in_features
            mlp.gate_up_proj.weight[inter:].div_(s_down[:, None])  # silu(gate) * up: scale up's outputs
            mlp.down_proj.weight.mul_(s_down)
        if s_o is not None:  # attention output channel c is a mix of v's channel c
            v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
            attn.qkv_proj.weight[v_rows].div_(s_o[:, None])
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias[v_rows].div_(s_o)
            attn.o_proj.weight.mul_(s_o)


def scale_layer(layer, hessians: dict[str, torch.Tensor], schemes: dict[str, WeightScheme | None]) -> dict:
    """Search and fold the scales of one decoder layer; returns {linear: alpha, error ratio}.

    `hessians` and `schemes` are keyed by the layer's module names (self_attn.qkv_proj,
    ...); hessians are transformed in place to the scaled inputs (H / s s^T).
    """
    attn = layer.self_attn
    found, chosen = {}, {}
    targets = {"self_attn.qkv_proj": "s_qkv", "mlp.gate_up_proj": "s_gate_up", "mlp.down_proj": "s_down"}
    if attn.num_heads == attn.num_kv_heads:  # with GQA, o's input channels share v's: no single scale
        targets["self_attn.o_proj"] = "s_o"
    for name, arg in targets.items():
        if schemes.get(name) is None:
            continue
        s, alpha, ratio = search_scale(layer.get_submodule(name).weight.float(), hessians[name], schemes[name])
        chosen[arg] = s
        found[name] = {"alpha": alpha, "error_ratio": round(ratio, 4)}
        hessians[name] = hessians[name] / (s[:, None] * s[None, :])
    fold_scales(layer, **chosen)
    return found
