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
- **Rotations.** `transform_config` (compressed-tensors' TransformConfig) records the
  orthogonal transforms applied before quantizing (QuaRot / SpinQuant's R1 and R4): those
  folded into weights need nothing more; those applied to activations at run time store
  their matrices per module (`read_transforms`), re-checked as rotations when read.
- **Identity.** `artifact_sha256` hashes the files that define the model (weights, config,
  tokenizer), not quantpipe.json (the manifest, which records timings) nor kernels.json
  (the kernel choices, rebuilt per device): the eval report, the gate verdict and the
  registry name a candidate by this hash, so a changed weight file is a new model. `seal`
  computes it once, when the artifact is written, and records it in quantpipe.json;
  `read_manifest` reads that manifest back, validated.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.formats.packing import MAX_BITS, pack_int32, packed_words, unpack_int32
from quantpipe.manifest import StageError, sha256_bytes, sha256_file, write_json

MANIFEST = "quantpipe.json"
NOT_MODEL_FILES = (MANIFEST, "kernels.json")
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map
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
        bits = w.get("num_bits")
        if w.get("type", "int") != "int" or not (isinstance(bits, int) and 2 <= bits <= MAX_BITS):
            raise ValueError(f"quantization_config.config_groups.{name}.weights: int weights of 2 to {MAX_BITS} bits "
                             f"only, got {w.get('type')} {bits}")
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
    _transform_groups(qcfg)


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
        if packed.dtype != torch.int32 or packed.shape[0] != n or packed.shape[1] != packed_words(bits, k):
            raise ValueError(f"{p}weight_packed has shape {tuple(packed.shape)} {packed.dtype}; expected int32 "
                             f"[{n}, {packed_words(bits, k)}] for {bits}-bit weights of shape [{n}, {k}]")
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
            if tuple(zero.shape) != (packed_words(bits, n), groups):
                raise ValueError(f"{p}weight_zero_point has shape {tuple(zero.shape)}; expected int32 "
                                 f"[{packed_words(bits, n)}, {groups}] for {bits}-bit zero points of {n} rows")
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


# -- rotations: compressed-tensors' transform_config -------------------------------------
# A rotation folded into the weights (`weight_input` / `weight_output`) is recorded and needs
# nothing at run time; one applied to activations (`input` / `output`, "online") stores its
# matrix per module as `<module>.<scheme>_<location>.weight`, the names compressed-tensors and
# vLLM give it. `hadamard` stores Sylvester's +-1 matrix of size head_dim (applied scaled by
# 1/sqrt(size), block by block); `random-matrix` stores the orthogonal matrix itself.
TRANSFORM_TYPES = ("hadamard", "random-matrix")
TRANSFORM_LOCATIONS = ("input", "output", "weight_input", "weight_output")
_TRANSFORM_TENSOR = re.compile(r"^(.*)\.([A-Za-z0-9]+)_(input|output)\.weight$")


def sylvester_hadamard(size: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of a power-of-two size, entries +-1 (float32)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {size}")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@dataclass
class OnlineTransform:
    """A rotation of one module's activations at run time: x -> x @ M (`inverse`: x @ M^T),
    M orthogonal [b, b] applied to each block of b channels; `location` "input" rotates what the
    module reads, "output" what it returns."""

    module: str  # the checkpoint's module name
    location: str
    matrix: torch.Tensor  # float32, orthogonal
    inverse: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.matrix.device != x.device:
            self.matrix = self.matrix.to(x.device)
        m = self.matrix.T if self.inverse else self.matrix
        b = m.shape[0]
        return (x.float().unflatten(-1, (-1, b)) @ m).flatten(-2).to(x.dtype)


def transform_tensor(module: str, scheme: str, location: str, stored: torch.Tensor) -> dict[str, torch.Tensor]:
    """One online transform's tensor under its checkpoint name (the inverse of `read_transforms`)."""
    return {f"{module}.{scheme}_{location}.weight": stored.float().clone().contiguous()}


def _transform_groups(qcfg: dict) -> dict:
    tc = qcfg.get("transform_config")
    if not tc:  # absent, or {} as llm-compressor writes when nothing was applied
        return {}
    where = "quantization_config.transform_config"
    groups = tc.get("config_groups") if isinstance(tc, dict) else None
    if not isinstance(groups, dict):
        raise ValueError(f"{where}: must hold config_groups, a mapping of scheme name to scheme")
    for name, scheme in groups.items():
        w = f"{where}.config_groups.{name}"
        if not isinstance(scheme, dict) or scheme.get("type") not in TRANSFORM_TYPES:
            raise ValueError(f"{w}.type: one of {', '.join(TRANSFORM_TYPES)} is supported, got "
                             f"{scheme.get('type') if isinstance(scheme, dict) else scheme!r}")
        for i, args in enumerate(scheme.get("apply") or []):
            if args.get("location") not in TRANSFORM_LOCATIONS:
                raise ValueError(f"{w}.apply[{i}].location: one of {', '.join(TRANSFORM_LOCATIONS)} is supported "
                                 f"(rotations of attention's q and k are not), got {args.get('location')!r}")
    return groups


def _targeted(module: str, targets, ignore) -> bool:
    """Whether a transform's targets name `module` (by name or regex, never by class) and its
    ignore list does not."""
    return _matches(module, targets or [], "") and not _matches(module, ignore or [], "")


def online_targets(qcfg: dict) -> list[tuple[str, str, list[str], list[str]]]:
    """(scheme, location, targets, ignore) of every transform applied at run time."""
    return [(name, a["location"], list(a.get("targets") or []), list(a.get("ignore") or []))
            for name, scheme in _transform_groups(qcfg).items() for a in scheme.get("apply") or []
            if a["location"] in ("input", "output")]


def read_transforms(qcfg: dict, state: dict[str, torch.Tensor]) -> list[OnlineTransform]:
    """Pop the online transforms' tensors from `state`, each checked against transform_config
    (its scheme applies there online, to a module its targets name) and re-checked as a
    rotation: a `hadamard` matrix must be Sylvester's, a `random-matrix` orthogonal."""
    groups = _transform_groups(qcfg)
    out = []
    for key in [k for k in state if _TRANSFORM_TENSOR.match(k)]:
        module, scheme_name, location = _TRANSFORM_TENSOR.match(key).groups()
        scheme = groups.get(scheme_name)
        if scheme is None:
            raise ValueError(f"tensor {key}: transform_config has no scheme {scheme_name!r}")
        args = [a for a in scheme.get("apply") or [] if a["location"] == location
                and _targeted(module, a.get("targets"), a.get("ignore"))]
        if len(args) != 1:
            raise ValueError(f"tensor {key}: {len(args)} of transform_config.config_groups.{scheme_name}'s "
                             f"'{location}' entries target {module}; expected exactly 1")
        stored = state.pop(key).double()
        b = stored.shape[0]
        head_dim = scheme.get("head_dim")
        if stored.dim() != 2 or stored.shape[1] != b or (head_dim is not None and b != head_dim):
            raise ValueError(f"tensor {key}: shape {tuple(stored.shape)}; expected a square matrix"
                             f"{f' of head_dim {head_dim}' if head_dim else ''}")
        if scheme["type"] == "hadamard":
            if not torch.equal(stored, sylvester_hadamard(b).double()):
                raise ValueError(f"tensor {key}: not the Sylvester Hadamard matrix of size {b} that type "
                                 f"'hadamard' names")
            m = stored / math.sqrt(b)
        else:
            m = stored
            err = (m @ m.T - torch.eye(b, dtype=m.dtype)).abs().max().item()
            if err > 1e-4:
                raise ValueError(f"tensor {key}: not orthogonal (|M M^T - I| reaches {err:.2g}; the limit is 1e-4)")
        out.append(OnlineTransform(module, location, m.float(), bool(args[0].get("inverse", False))))
    return out


def check_transforms_cover(qcfg: dict, transforms: list[OnlineTransform], modules: list[str]) -> None:
    """Refuse a model one of whose `modules` (checkpoint names) an online transform of
    transform_config targets without a tensor for it: served without it, the module would
    read activations in the wrong basis."""
    have = {(t.module, t.location) for t in transforms}
    for scheme, location, targets, ignore in online_targets(qcfg):
        for m in modules:
            if _targeted(m, targets, ignore) and (m, location) not in have:
                raise ValueError(f"transform_config.config_groups.{scheme} rotates the {location} of {m} at run time, "
                                 f"but the checkpoint has no tensor {m}.{scheme}_{location}.weight")


DEFAULT_MAX_SHARD_BYTES = 5 * 1000 ** 3  # "5GB", transformers' save_pretrained default


class CheckpointWriter:
    """A checkpoint's weights written as they are computed, in groups (one decoder layer's
    tensors, say) that are never split across files: a group joins the pending shard unless
    that would take it past `max_shard_bytes`, in which case the pending shard is written
    first. One shard is model.safetensors; more are model-0000i-of-0000n.safetensors with
    model.safetensors.index.json, as transformers' save_pretrained writes them. The same
    groups in the same order give the same files, whether a model was quantized whole or
    streamed one layer at a time; at most one shard (or one larger group) is held in memory."""

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if len(tensors) == 1 and size > self.max_shard_bytes:
            (name, t), = tensors.items()
            self.add_rows(name, list(t.shape), t.dtype, lambda: iter([t]))
            return
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending.update(tensors)
        self._pending_bytes += size
        self.total_bytes += size

    def add_rows(self, name: str, shape: list[int], dtype: torch.dtype, chunks) -> None:
        """One tensor given as `chunks()`, an iterator over its row ranges in order. Larger than a
        shard, it is written alone to a file of its own as the ranges arrive (an embedding
        larger than memory never is whole in it); otherwise it joins the pending shard."""
        item = torch.empty(0, dtype=dtype).element_size()
        size = item * math.prod(shape)
        if size <= self.max_shard_bytes:
            self.add({name: torch.cat(list(chunks())).reshape(shape)})
            return
        if self._pending:
            self._flush()
        header = {"__metadata__": {"format": "pt"},
                  name: {"dtype": _SAFETENSORS_NAMES[dtype], "shape": shape, "data_offsets": [0, size]}}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        f = self.folder / f".shard-{len(self._shards)}.tmp"
        written = 0
        with open(f, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little") + raw)
            for c in chunks():
                data = c.contiguous().view(torch.uint8).numpy()
                fh.write(memoryview(data).cast("B"))
                written += data.nbytes
        if written != size:
            raise ValueError(f"tensor {name!r}: its row ranges gave {written} bytes, its shape {shape} needs {size}")
        self._shards.append((f, [name]))
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        f = self.folder / f".shard-{len(self._shards)}.tmp"
        save_file(self._pending, str(f), metadata={"format": "pt"})
        self._shards.append((f, sorted(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self, config: dict) -> None:
        """Write the last shard, name the shards, and write config.json (with its quantization_config)."""
        validate(config["quantization_config"])
        if self._pending or not self._shards:
            self._flush()
        for f, _ in self._shards:  # safetensors writes its files owner-only; weights are ordinary files
            os.chmod(f, 0o644)
        n = len(self._shards)
        if n == 1:
            os.replace(self._shards[0][0], self.folder / WEIGHTS_FILE)
        else:
            weight_map = {}
            for i, (f, names) in enumerate(self._shards, 1):
                name = f"model-{i:05d}-of-{n:05d}.safetensors"
                os.replace(f, self.folder / name)
                weight_map.update(dict.fromkeys(names, name))
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (self.folder / "config.json").write_text(json.dumps(config, indent=2))


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



def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """A model folder's safetensors files, and its index's tensor -> file map when it has one."""
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
    return files, weight_map


def _tensor_files(files: list[Path], names_of, weight_map: dict[str, str] | None) -> dict[str, Path]:
    """tensor name -> the file holding it, checked against the index (or, without one, against
    every other file): `names_of(f)` lists the tensors file f holds."""
    where: dict[str, Path] = {}
    for f in files:
        for name in names_of(f):
            if weight_map is not None and weight_map.get(name) != f.name:
                raise ValueError(f"{f}: holds tensor {name!r}, which {INDEX_FILE} maps to "
                                 f"{weight_map.get(name) or 'no shard'}")
            if name in where:
                raise ValueError(f"{f}: tensor {name!r} is also in another *.safetensors file of the folder "
                                 f"(and there is no {INDEX_FILE} to say which is meant)")
            where[name] = f
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(where))
        if absent:
            raise ValueError(f"{files[0].parent / INDEX_FILE}: maps tensor {absent[0]!r} to "
                             f"{weight_map[absent[0]]}, which does not hold it")
    return where


def load_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor of its safetensors files); errors name the file.

    A sharded checkpoint is read through its index: exactly the shards it names, each tensor
    from the shard the index maps it to. Without an index every *.safetensors file is read,
    and a tensor in two of them is refused (which one is meant is unknowable)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_config(path)
    files, weight_map = _checkpoint_files(path)
    loaded: dict[Path, dict[str, torch.Tensor]] = {}
    for f in files:
        try:
            loaded[f] = load_file(f)
        except SafetensorError as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    where = _tensor_files(files, lambda f: loaded[f].keys(), weight_map)
    return config, {name: loaded[f][name] for name, f in where.items()}


class CheckpointReader:
    """A model folder's tensors read one at a time, for models larger than memory: each read
    copies the tensor (or a range of its rows) from its file into memory of its own with plain
    reads, so no file is mapped and only what was asked for is resident. The same checks as
    `load_checkpoint`, on each file's safetensors header."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.config = read_config(self.path)
        files, weight_map = _checkpoint_files(self.path)
        self._entries: dict[str, tuple[Path, int, str, list[int]]] = {}  # name -> (file, offset, dtype, shape)

        def names_of(f: Path) -> list[str]:
            entries = _safetensors_header(f)
            self._entries.update({n: (f, *e) for n, e in entries.items()})
            return list(entries)

        self._where = _tensor_files(files, names_of, weight_map)

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> list[int]:
        return self._entries[name][3]

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` as stored (its rows [a, b) only, when given)."""
        f, offset, dtype, shape = self._entries[name]
        torch_dtype, item = _SAFETENSORS_DTYPES[dtype]
        a, b = rows if rows is not None else (0, shape[0] if shape else 1)
        row = item * math.prod(shape[1:])
        out = torch.empty([b - a, *shape[1:]] if shape else [], dtype=torch_dtype)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
        with open(f, "rb") as fh:
            fh.seek(offset + a * row)
            if fh.readinto(view) != len(view):
                raise ValueError(f"{f}: tensor {name!r} runs past the end of the file")
        return out


def _safetensors_header(f: Path) -> dict[str, tuple[int, str, list[int]]]:
    """A safetensors file's tensors: name -> (offset of its data in the file, dtype, shape),
    each checked against the file's size; errors name the file."""
    try:
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            raw = fh.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= min(size - 8, 100 * 1024 ** 2):
                raise ValueError(f"{f}: not a readable safetensors file (header length {n} in a {size}-byte file)")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise ValueError(f"{f}: not readable ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not a readable safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{f}: not a readable safetensors file (its header is not a JSON object)")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            item = _SAFETENSORS_DTYPES[dtype][1]
            if not (isinstance(start, int) and isinstance(end, int)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{f}: tensor {name!r} has a malformed or unsupported header entry {info!r}") from None
        if end - start != item * math.prod(shape) or not 0 <= start <= end <= size - 8 - n:
            raise ValueError(f"{f}: tensor {name!r} has data offsets {[start, end]} that do not match its shape "
                             f"{shape} and {dtype} or the file's {size} bytes")
        out[name] = (8 + n + start, dtype, shape)
    return out


_SAFETENSORS_DTYPES = {"F64": (torch.float64, 8), "I64": (torch.int64, 8), "F32": (torch.float32, 4),
                       "I32": (torch.int32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
                       "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
                       "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1)}
_SAFETENSORS_NAMES = {dtype: name for name, (dtype, _) in _SAFETENSORS_DTYPES.items()}


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
