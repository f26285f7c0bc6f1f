"""Reading compressed-tensors checkpoints (quantpipe's artifacts and llm-compressor's).

`quantization_config` in config.json says which Linear modules are quantized and how
(`config_groups`: targets, weight args; `ignore`); each quantized module stores
`weight_packed` (int32, `pack-quantized`) or an int8 `weight` (`int-quantized`), with
`weight_scale`, `weight_zero_point` when asymmetric, and `weight_shape`.
"""

from __future__ import annotations

import re

import torch

from quantpipe.formats.packing import pack_factor, unpack_int32
from quantpipe.runtime.model.quantized import QuantWeight

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "mixed-precision")


def _matches(name: str, targets: list[str], class_name: str = "Linear") -> bool:
    for t in targets:
        if t.startswith("re:"):
            if re.match(t[3:], name):
                return True
        elif t == class_name or t == name or name.endswith("." + t):
            return True
    return False


def scheme_of(qcfg: dict, module: str) -> dict | None:
    """The weight args of the config group that quantizes `module` (an HF name), or None."""
    if _matches(module, qcfg.get("ignore") or []):
        return None
    best = None
    for group in (qcfg.get("config_groups") or {}).values():
        targets = group.get("targets") or []
        if _matches(module, targets):
            # A regex naming the module beats the catch-all class name.
            specific = any(t != "Linear" for t in targets if _matches(module, [t]))
            if best is None or specific:
                best = group
    return best


def validate(qcfg: dict) -> None:
    if qcfg.get("quant_method") != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {qcfg.get('quant_method')!r} is not supported; "
                         f"only compressed-tensors")
    fmt = qcfg.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"quantization_config.format {fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    for name, group in (qcfg.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            raise ValueError(f"quantization_config.config_groups.{name}.weights: int4 or int8 weights only, "
                             f"got {w.get('type')} {w.get('num_bits')}")
        if w.get("strategy") not in ("channel", "group"):
            raise ValueError(f"quantization_config.config_groups.{name}.weights.strategy {w.get('strategy')!r}: "
                             f"channel or group only")
        a = group.get("input_activations")
        if a is not None and not (a.get("num_bits") == 8 and a.get("type", "int") == "int"
                                  and a.get("strategy") == "token" and a.get("dynamic") and a.get("symmetric", True)):
            raise ValueError(f"quantization_config.config_groups.{name}.input_activations: only dynamic symmetric "
                             f"per-token int8 is supported, got {a}")
        if w.get("actorder") == "group":
            raise ValueError(f"quantization_config.config_groups.{name}.weights.actorder 'group' (g_idx) is not "
                             f"supported; 'weight' is")


def kv_cache_kind(qcfg: dict) -> tuple[str, bool]:
    """("auto" | "int8" | "fp8", static scales or not) of a quantization_config's
    kv_cache_scheme, validated; what readers that need no tensors ask (the eval's memory figures)."""
    kv = qcfg.get("kv_cache_scheme")
    if not kv:
        return "auto", False
    kind = (kv.get("type", "int"), kv.get("num_bits"))
    if kind not in (("int", 8), ("float", 8)):
        raise ValueError(f"quantization_config.kv_cache_scheme: 8-bit int or float only, got {kind[0]} {kind[1]}")
    name = "int8" if kind[0] == "int" else "fp8"
    strategy = kv.get("strategy")
    if kv.get("dynamic"):
        if strategy != "token":
            raise ValueError(f"quantization_config.kv_cache_scheme: a dynamic scheme must use strategy 'token' "
                             f"(a scale per token and KV head), got {strategy!r}")
        return name, False
    if strategy not in ("channel", "attn_head", "tensor") or not kv.get("symmetric", True):
        raise ValueError(f"quantization_config.kv_cache_scheme: a static scheme must be symmetric with strategy "
                         f"'channel', 'attn_head' or 'tensor', got {strategy!r}, symmetric={kv.get('symmetric')}")
    return name, True


def kv_cache_format(qcfg: dict, state: dict[str, torch.Tensor], num_layers: int, kv_heads: int,
                    head_dim: int) -> tuple[str, list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """The runtime's KV cache format for `kv_cache_scheme`: ("auto" | "int8" | "fp8", static scales).

    Dynamic schemes (strategy `token`) get a scale per token and KV head at run time.
    Static ones carry `self_attn.k_scale` / `v_scale` per layer: one per KV head and
    channel (`channel`, quantpipe's), per KV head (`attn_head`) or one for the layer
    (`tensor`, as llm-compressor writes fp8), popped from `state` per layer as
    [KVH, 1] or [KVH, D].
    """
    name, static = kv_cache_kind(qcfg)
    if not static:
        return name, None
    prefix = "model." if any(k.startswith("model.") for k in state) else ""
    scales = []
    for i in range(num_layers):
        pair = []
        for t in ("k_scale", "v_scale"):
            key = f"{prefix}layers.{i}.self_attn.{t}"
            s = state.pop(key, None)
            if s is None:
                raise ValueError(f"{key} is missing for the static kv_cache_scheme")
            if s.numel() not in (1, kv_heads, kv_heads * head_dim) or not torch.isfinite(s).all() or (s <= 0).any():
                raise ValueError(f"{key} must hold 1, {kv_heads} or {kv_heads * head_dim} positive scales, "
                                 f"got shape {tuple(s.shape)}")
            pair.append(s.float().reshape(-1, 1).expand(kv_heads, 1).clone() if s.numel() == 1 else
                        s.float().reshape(kv_heads, -1).clone())
        scales.append((pair[0], pair[1]))
    return name, scales


def read_quantized(state: dict[str, torch.Tensor], qcfg: dict, module: str) -> QuantWeight | None:
    """Pop `module`'s quantized tensors from `state` into a QuantWeight (None: not quantized)."""
    group = scheme_of(qcfg, module)
    if group is None:
        return None
    w = group["weights"]
    bits, strategy = w["num_bits"], w["strategy"]
    gs = w.get("group_size") if strategy == "group" else None
    fmt = group.get("format") or qcfg.get("format")
    p = module + "."
    scale = state.pop(p + "weight_scale", None)
    if scale is None:
        raise ValueError(f"{p}weight_scale is missing for a quantized layer")
    shape = state.pop(p + "weight_shape", None)
    if fmt == "pack-quantized" or p + "weight_packed" in state:
        packed = state.pop(p + "weight_packed", None)
        if packed is None or shape is None:
            raise ValueError(f"{p}weight_packed / weight_shape missing for a pack-quantized layer")
        n, k = (int(v) for v in shape.tolist())
        if packed.dtype != torch.int32 or packed.shape[0] != n or packed.shape[1] != -(-k // pack_factor(bits)):
            raise ValueError(f"{p}weight_packed has shape {tuple(packed.shape)} {packed.dtype}; expected int32 "
                             f"[{n}, {-(-k // pack_factor(bits))}] for {bits}-bit weights of shape [{n}, {k}]")
        q = unpack_int32(packed, bits, k)
    else:
        q = state.pop(p + "weight", None)
        if q is None or q.dtype != torch.int8:
            raise ValueError(f"{p}weight must be int8 in an int-quantized layer")
        n, k = q.shape
    groups = k // gs if gs else 1
    if gs and k % gs:
        raise ValueError(f"{p}: group_size {gs} does not divide the input size {k}")
    if tuple(scale.shape) != (n, groups):
        raise ValueError(f"{p}weight_scale has shape {tuple(scale.shape)}; expected [{n}, {groups}]")
    zero = state.pop(p + "weight_zero_point", None)
    if w.get("symmetric", True):
        zero = None
    else:
        if zero is None:
            raise ValueError(f"{p}weight_zero_point is missing for an asymmetric layer")
        if zero.dtype == torch.int32 and fmt == "pack-quantized":
            zero = unpack_int32(zero, bits, n, dim=0)
        if tuple(zero.shape) != (n, groups):
            raise ValueError(f"{p}weight_zero_point has shape {tuple(zero.shape)}; expected [{n}, {groups}]")
    state.pop(p + "weight_g_idx", None)  # actorder 'weight' keeps the plain column order
    act_bits = 8 if group.get("input_activations") else None
    return QuantWeight(q, scale.float(), None if zero is None else zero.float(), bits, gs, act_bits)
