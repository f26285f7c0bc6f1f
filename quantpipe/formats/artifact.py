"""The quantized artifact: a compressed-tensors checkpoint folder plus quantpipe.json.

One module writes, reads and validates it; the quantize stage, the runtime loader, the
kernels build, eval, gate and publish all go through it.

- **Weights.** `quantization_config` in config.json says which Linear modules are
  quantized and how (`config_groups`: targets, weight args; `ignore`); each quantized
  module stores `weight_packed` (int32, `pack-quantized`, see `formats.packing`) or an
  int8 `weight` (`int-quantized`), with `weight_scale`, `weight_zero_point` when
  asymmetric, and `weight_shape`. `quantized_tensors` writes one module's tensors and
  `read_quantized` reads them back into a `QuantWeight`, side by side. llm-compressor's
  checkpoints read the same way.
- **KV cache.** `kv_cache_scheme`, with static `self_attn.k_scale` / `v_scale` per layer
  (`kv_cache_kind`, `kv_cache_format`). A dynamic scheme (strategy `token`) stores
  nothing: its scales are computed as tokens are cached, on the runtime's own grid
  (kv_cache.py: symmetric per token and KV head, in a rotated basis), as vLLM lays out
  its own per-token cache; quantpipe writes `symmetric: true` and reads either.
- **Identity.** `artifact_sha256` hashes the files that define the model (weights, config,
  tokenizer), not quantpipe.json (the manifest, which records timings) nor kernels.json
  (the kernel choices, rebuilt per device): the eval report, the gate verdict and the
  registry name a candidate by this hash, so a changed weight file is a new model. `seal`
  computes it once, when the artifact is written, and records it in quantpipe.json;
  `read_manifest` reads that manifest back, validated.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.formats.packing import pack_factor, pack_int32, unpack_int32
from quantpipe.manifest import StageError, sha256_bytes, sha256_file, write_json

MANIFEST = "quantpipe.json"
NOT_MODEL_FILES = (MANIFEST, "kernels.json")
WEIGHTS_FILE = "model.safetensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "mixed-precision")


@dataclass
class QuantWeight:
    """One Linear's weights on an integer grid: w ~ (q - zero) * scale per group along K."""

    q: torch.Tensor  # int8 [N, K], values in [-2^(b-1), 2^(b-1) - 1]
    scale: torch.Tensor  # [N, G]
    zero: torch.Tensor | None  # [N, G] integer-valued, None when symmetric
    num_bits: int
    group_size: int | None  # None: per output channel
    act_bits: int | None = None  # 8: activations quantized per token at run time (W8A8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        gs = self.group_size or k
        g = self.q.float().reshape(n, k // gs, gs)
        if self.zero is not None:
            g = g - self.zero.float().unsqueeze(-1)
        return (g * self.scale.float().unsqueeze(-1)).reshape(n, k).to(dtype)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack along the output dimension (q/k/v or gate/up fused into one matmul)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.num_bits, p.group_size, p.zero is None) != (first.num_bits, first.group_size, first.zero is None):
                raise ValueError("fused projections (q/k/v or gate/up) must share one quantization scheme")
        zero = None if first.zero is None else torch.cat([p.zero for p in parts], 0)
        if any(p.act_bits != first.act_bits for p in parts):
            raise ValueError("fused projections (q/k/v or gate/up) must share one activation scheme")
        return QuantWeight(torch.cat([p.q for p in parts], 0), torch.cat([p.scale for p in parts], 0), zero,
                           first.num_bits, first.group_size, first.act_bits)



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


def quantized_tensors(module: str, qw: QuantWeight, fmt: str, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`module`'s tensors in the checkpoint (the inverse of `read_quantized`): `int-quantized`
    keeps the int8 values as they are, `pack-quantized` packs them into int32 words."""
    p = module + "."
    if fmt == "int-quantized":
        out = {p + "weight": qw.q.to(torch.int8).contiguous()}
    elif fmt == "pack-quantized":
        out = {p + "weight_packed": pack_int32(qw.q, qw.num_bits),
               p + "weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64)}
    else:
        raise ValueError(f"format {fmt!r}: a layer is written as pack-quantized or int-quantized")
    out[p + "weight_scale"] = qw.scale.to(scale_dtype).contiguous()
    if qw.zero is not None:
        out[p + "weight_zero_point"] = pack_int32(qw.zero.to(torch.int8), qw.num_bits, dim=0)
    return out


def kv_scale_tensors(scales: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Static KV scales per layer (K, V) under the names `kv_cache_format` reads."""
    return {f"model.layers.{i}.self_attn.{t}": s.float().contiguous()
            for i, pair in enumerate(scales) for t, s in zip(("k_scale", "v_scale"), pair)}


def write_checkpoint(folder: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """The checkpoint files: the tensors and config.json (with its quantization_config)."""
    from safetensors.torch import save_file

    validate(config["quantization_config"])
    save_file(tensors, str(Path(folder) / WEIGHTS_FILE), metadata={"format": "pt"})
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2))


def seal(folder: str | os.PathLike, manifest: dict) -> dict:
    """Record the artifact's hash in `manifest` and write it as quantpipe.json: the last file
    of an artifact, written once every file the hash covers is in place."""
    manifest = dict(manifest, artifact_sha256=artifact_sha256(folder))
    write_json(Path(folder) / MANIFEST, manifest)
    return manifest


def read_config(path: str | os.PathLike) -> dict:
    """A model folder's config.json; errors name the file."""
    f = Path(path) / "config.json"
    try:
        config = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{f}: missing (not a model folder)") from None
    except OSError as e:
        raise ValueError(f"{f}: not readable ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{f}: not a JSON object")
    return config


INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map


def load_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor of its safetensors files); errors name the file.

    A sharded checkpoint is read through its index: exactly the shards it names, each tensor
    from the shard the index maps it to. Without an index every *.safetensors file is read,
    and a tensor in two of them is refused (which one is meant is unknowable)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_config(path)
    weight_map = _read_index(path / INDEX_FILE) if (path / INDEX_FILE).exists() else None
    if weight_map is not None:
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{path / INDEX_FILE}: names shard {missing[0].name}, which is not in the folder")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(path)!r} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f)
        except SafetensorError as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
        for name, t in tensors.items():
            if weight_map is not None and weight_map.get(name) != f.name:
                raise ValueError(f"{f}: holds tensor {name!r}, which {INDEX_FILE} maps to "
                                 f"{weight_map.get(name) or 'no shard'}")
            if name in state:
                raise ValueError(f"{f}: tensor {name!r} is also in another *.safetensors file of the folder "
                                 f"(and there is no {INDEX_FILE} to say which is meant)")
            state[name] = t
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(state))
        if absent:
            raise ValueError(f"{path / INDEX_FILE}: maps tensor {absent[0]!r} to {weight_map[absent[0]]}, "
                             "which does not hold it")
    return config, state


def _read_index(f: Path) -> dict[str, str]:
    try:
        index = json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{f}: not readable ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v.endswith(".safetensors") and "/" not in v
            for k, v in weight_map.items()):
        raise ValueError(f"{f}: weight_map must map tensor names to .safetensors files of the folder")
    return weight_map


# -- identity ----------------------------------------------------------------------------

def artifact_sha256(path: str | os.PathLike) -> str:
    path = Path(path)
    parts = [f"{f.name}:{sha256_file(f)}" for f in sorted(path.iterdir())
             if f.is_file() and f.name not in NOT_MODEL_FILES]
    return sha256_bytes("\n".join(parts).encode())


def model_sha256(path: str | os.PathLike) -> str:
    """A GGUF file's own hash, or a model folder's artifact hash."""
    return sha256_file(path) if os.path.isfile(path) else artifact_sha256(path)


def read_manifest(path: str | os.PathLike, what: str = "artifact") -> dict:
    """An artifact's quantpipe.json; a clear error naming `what` when it is not one."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        raise StageError(f"{what} {path}: not a quantpipe artifact (no {MANIFEST}); make one with "
                         f"`quantpipe quantize`")
    try:
        manifest = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StageError(f"{what} {path}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("stage") != "quantize":
        raise StageError(f"{what} {path}: {MANIFEST} is not a quantize manifest (needs stage 'quantize')")
    src = manifest.get("source_model")
    if not isinstance(src, dict) or not isinstance(src.get("sha256"), str):
        raise StageError(f"{what} {path}: {MANIFEST} has no source_model.sha256 (the model it was quantized from)")
    return manifest
