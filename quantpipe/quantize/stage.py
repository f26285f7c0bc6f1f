"""`quantize(model, QuantConfig, calib) -> Artifact`: weights onto an integer grid, written as a
compressed-tensors checkpoint the runtime (and vLLM) load.

Fused projections (q/k/v, gate/up) are quantized as one matrix: rows are independent
under both RTN and GPTQ (groups run along the input dimension and GPTQ's error
feedback too), so this equals quantizing each projection alone, and the artifact stores
them unfused under the source checkpoint's names, as vLLM expects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantpipe.formats.artifact import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointWriter,
    QuantWeight,
    kv_scale_tensors,
    model_sha256,
    quantized_tensors,
    read_manifest,
    seal,
)
from quantpipe.formats.calib_set import CalibSet
from quantpipe.manifest import (
    MANIFEST_VERSION,
    StageError,
    code_version,
    sha256_bytes,
    sha256_file,
    staged_output,
)
from quantpipe.quantize import autoround, awq, rotate
from quantpipe.quantize.config import QuantConfig
from quantpipe.quantize.gptq import HessianError, gptq
from quantpipe.quantize.rtn import WeightScheme, rtn
from quantpipe.quantize.stream import (
    Activations,
    MemoryPlan,
    ResidentLayers,
    StreamedLayers,
    map_large_allocations,
    mib,
    plan_memory,
    reset_peak,
    resident_bytes,
    spill_folder,
)
from quantpipe.runtime.model.config import checkpoint_name, fused_linears, routers
from quantpipe.runtime.model.export import export_tokenizer, hf_config, hf_state_dict
from quantpipe.runtime.model.forward import SequencePass
from quantpipe.runtime.model.llama import SparseMoE
from quantpipe.runtime.model.loader import ROW_RANGE_BYTES

log = logging.getLogger("quantpipe.quantize")


@dataclass
class Artifact:
    path: Path
    manifest: dict


def calibration_texts(calib: str | None) -> tuple[list[str], dict]:
    """Texts from a `quantpipe calibrate` set (its calib.jsonl), or any text file ("generic")."""
    if calib is None:
        return [], {"kind": "none"}
    p = Path(calib)
    if p.is_dir():
        cs = CalibSet.open(p)
        return cs.texts("calib"), {"kind": "calibrate", **cs.info("calib"), "strata": cs.strata()}
    if p.is_file():
        return _generic_texts(p), {"kind": "generic", "path": str(p), "sha256": sha256_file(p)}
    raise StageError(f"--calib {calib}: no such file or folder")


def _generic_texts(p: Path) -> list[str]:
    """Paragraphs of a text file, or the `text` of each line of a JSONL file (.gz, .zst too)."""
    from quantpipe.calibrate.sources import open_lines, uncompressed_name

    lines = open_lines(str(p), "--calib")
    if not uncompressed_name(str(p)).endswith(".jsonl"):
        return [t.strip() for t in "".join(line for _, line, _ in lines).split("\n\n") if t.strip()]
    texts = []
    for n, line, _ in lines:
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise StageError(f"--calib {p}: line {n} is not a JSON object with a string field 'text'")
            texts.append(row["text"])
    return texts


def _token_samples(texts: list[str], tokenizer, cfg: QuantConfig) -> list[list[int]]:
    """calib_samples sequences of at most calib_seq_len tokens, texts in a seeded order."""
    order = np.random.default_rng(0).permutation(len(texts))
    out = []
    for i in order:
        ids = tokenizer.encode(texts[i])[: cfg.calib_seq_len]
        if len(ids) >= 8:
            out.append(ids)
        if len(out) == cfg.calib_samples:
            break
    return out


def _rtn(w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype, clip: str = "minmax") -> QuantWeight:
    """Round to nearest, the scale stored in the artifact's dtype."""
    q, scale, zero = rtn(w, scheme, clip)
    return QuantWeight(q, scale.to(scale_dtype).float(), zero, scheme.num_bits, scheme.group_size)


def _split_rows(qw: QuantWeight, sizes: list[int]) -> list[QuantWeight]:
    out, start = [], 0
    for s in sizes:
        rows = slice(start, start + s)
        out.append(QuantWeight(qw.q[rows], qw.scale[rows], None if qw.zero is None else qw.zero[rows],
                               qw.num_bits, qw.group_size))
        start += s
    return out


def _hf_parts(model, name: str) -> list[tuple[str, int | None]]:
    """Checkpoint module names (and row counts) that our fused module `name` stands for."""
    cfg = model.config
    if name == "lm_head":
        return [("lm_head", cfg.vocab_size)]
    i, local = int(name.split(".")[1]), name.split(".", 2)[2]
    parts = dict(fused_linears(cfg, i))[local]
    if local.endswith("qkv_proj"):
        qs, kvs = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [qs, kvs, kvs]
    elif local.endswith("gate_up_proj"):
        inter = model.get_submodule(name).out_features // 2
        sizes = [inter, inter]
    else:
        sizes = [None]
    return [("model." + checkpoint_name(cfg, f"layers.{i}.{p}"), n) for p, n in zip(parts, sizes)]


def smooth(model, samples: list[list[int]], alpha: float) -> dict:
    """SmoothQuant: per input channel j, s_j = max|x_j|^alpha / max|w_j|^(1 - alpha); the
    RMSNorm before q/k/v (and before gate/up) is divided by s and those weights' columns
    multiplied by it, so the model computes the same function with tamer activations."""
    pairs = []
    for layer in model.layers:
        pairs.append((layer.attn_in_norm, layer.self_attn.qkv_proj))
        pairs.append((layer.mlp_in_norm, layer.mlp.gate_up_proj))
    amax = {id(lin): torch.zeros(lin.in_features) for _, lin in pairs}

    def hook(module, inputs, output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).abs().amax(0).float()
        torch.maximum(amax[id(module)], x, out=amax[id(module)])

    handles = [lin.register_forward_hook(hook) for _, lin in pairs]
    with torch.inference_mode():
        for ids in samples:
            run = SequencePass(model, ids)
            x = run.embed()
            for i in range(len(model.layers)):
                x = run.layer(i, x)
    for h in handles:
        h.remove()
    ratios = []
    with torch.no_grad():
        for norm, lin in pairs:
            w_max = lin.weight.abs().amax(0).clamp(min=1e-5)
            s = (amax[id(lin)].clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)
            norm.divide_(s)
            lin.weight.mul_(s.unsqueeze(0))
            ratios.append(float(amax[id(lin)].max() / amax[id(lin)].median().clamp(min=1e-8)))
    return {"alpha": alpha, "pairs": len(pairs), "outlier_ratio_max": round(max(ratios), 2)}


# GPTQ with clip="mse": each group's range shrink, searched by the layer's output error
# (H-weighted) before GPTQ fixes its grid. Up to 4 bits AWQ's steps of 5%; 8 bits (and the
# 5-7 of mixed precision, whose steps are as fine) 1% (a 5% step clips too much).
def gptq_clip_shrinks(num_bits: int) -> tuple[float, ...]:
    return awq.SHRINKS if num_bits <= 4 else tuple(1 - 0.01 * i for i in range(21))


class _InputsTaken(Exception):
    """Raised by the input hook of a layer's last Linear once its input is in: the rest of
    that calibration pass computes only the layer's output, which `_layer_hessians` drops."""


GRAM_BLOCK = 192  # columns per strip of `_add_gram`


def _add_gram(h: torch.Tensor, x: torch.Tensor) -> None:
    """h += x^T x in float64, only the strips of rows from the diagonal rightwards: x^T x is
    symmetric, so `_mirror` fills the rest once every sample is in. 0.65x the time of the
    full product at 576 inputs, 0.54x at 1536 (one core; BENCHMARKS.md, "GPTQ's Hessians")."""
    for i in range(0, x.shape[1], GRAM_BLOCK):
        h[i:i + GRAM_BLOCK, i:].addmm_(x[:, i:i + GRAM_BLOCK].t(), x[:, i:])


def _mirror(h: torch.Tensor) -> torch.Tensor:
    """The full matrix from the strips `_add_gram` accumulated (in place)."""
    for i in range(0, h.shape[0], GRAM_BLOCK):
        h[i + GRAM_BLOCK:, i:i + GRAM_BLOCK] = h[i:i + GRAM_BLOCK, i + GRAM_BLOCK:].t()
    return h


def _layer_hessians(i: int, mods: dict[str, torch.nn.Module], passes, xs, layer, all_experts: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """H = 2 X^T X / n (float32) of each Linear in `mods` of layer i over the calibration tokens
    reaching it, and how many tokens the router sent it (experts see only theirs).

    `all_experts`: each expert's H is taken over every token of the layer (each expert also
    runs on all of them, its outputs discarded); the layer's output still follows the router.

    Without experts, every pass calls the Linears in the same order, so after the first pass
    each stops at the last one's input (that pass's output is not used): on the default
    model the down projection is not computed twice per layer."""
    hs = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in mods.items()}
    rows = dict.fromkeys(mods, 0)
    routed = dict.fromkeys(mods, 0)
    probing = {"on": False}  # inside the all-experts pass
    order: list[str] | None = []  # the Linears in the order the first pass calls them; None after it
    last = None  # the Linear whose input ends each later pass (layers without experts)

    def hook(name):
        expert = ".experts." in name

        def f(module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            if not probing["on"]:
                routed[name] += x.shape[0]
                if expert and all_experts:  # its H comes from the all-experts pass
                    return
            # float64 throughout: float32 products per sequence (2x faster) lowered GPTQ's
            # top-1 agreement by 0.7 points on the CI gate's W4A16 candidate, past its tolerance.
            _add_gram(hs[name], x.double())
            rows[name] += x.shape[0]
            if order is not None:
                order.append(name)
            elif name == last:
                raise _InputsTaken
        return f

    def probe(moe, inputs):
        probing["on"] = True
        try:
            for expert in moe.experts:
                expert(inputs[0])
        finally:
            probing["on"] = False

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    if all_experts and isinstance(layer.mlp, SparseMoE):
        handles.append(layer.mlp.register_forward_pre_hook(probe))
    with torch.inference_mode():
        for p, x in zip(passes, xs):
            try:
                p.layer(i, x)
            except _InputsTaken:
                pass
            if order is not None:  # the first pass: each Linear once, in a fixed order without experts
                if not any(".experts." in n for n in mods) and sorted(order) == sorted(mods):
                    last = order[-1]
                order = None
    for hnd in handles:
        hnd.remove()
    return {n: (2 * _mirror(h) / max(rows[n], 1)).float() for n, h in hs.items()}, routed


def _expert_report(cfg, i: int, routed: dict[str, int], all_experts: bool) -> dict | None:
    """Tokens the router sent each expert of layer i, and the experts under the floor (2 x the
    largest input size of its Linears: fewer tokens than GPTQ's Hessian needs)."""
    if i not in cfg.moe_layers:
        return None
    tokens = [routed.get(f"mlp.experts.{e}.gate_up_proj", 0) for e in range(cfg.num_experts)]
    floor = 2 * max(cfg.hidden_size, cfg.moe_intermediate_size)
    return {"tokens_per_expert": tokens, "floor": floor, "under_floor": [e for e, n in enumerate(tokens) if n < floor],
            "hessian_tokens": "every token of the layer" if all_experts else "tokens routed to the expert"}


@torch.no_grad()  # the weights are parameters: no autograd graph through the searches (they held 50x a weight)
def _layerwise(model, samples: list[list[int]], schemes: dict[str, WeightScheme | None], cfg: QuantConfig,
               scale_dtype: torch.dtype, layers=ResidentLayers(), on_layer=None, spill: Path | None = None,
               damp_used: dict | None = None, awq_found: dict | None = None
               ) -> tuple[dict[str, QuantWeight], dict, dict, dict]:
    """GPTQ or AWQ, layer by layer: each layer calibrates on inputs that already passed the
    quantized layers before it, and only one layer's activations are held at a time.

    `layers` reads each decoder layer in before its turn and releases it after (streamed),
    `on_layer(i, weights)` takes its quantized weights as it is done (after `damp_used` and
    `awq_found`, when given, have that layer's records), and `spill` is a folder that holds
    the activations between layers instead of memory.
    Returns the quantized weights, the dampening GPTQ used per Linear, AWQ's scale search per
    Linear, and the experts' token counts per layer.
    """
    passes = [SequencePass(model, ids) for ids in samples]
    with torch.inference_mode():
        xs = Activations((p.embed() for p in passes), spill)
    out: dict[str, QuantWeight] = {}
    damp_used = {} if damp_used is None else damp_used
    awq_found = {} if awq_found is None else awq_found
    experts: dict[str, dict] = {}
    for i, layer in enumerate(model.layers):
        layers.load(i)
        mods = {n: layer.get_submodule(n) for n, _ in fused_linears(model.config, i) if schemes.get(f"layers.{i}.{n}")}
        hs, routed = _layer_hessians(i, mods, passes, xs, layer, cfg.calibrate_all_experts)
        report = _expert_report(model.config, i, routed, cfg.calibrate_all_experts)
        if report is not None:
            experts[f"layers.{i}"] = report
        if cfg.method == "awq":
            # H/2 = X^T X / n is what AWQ's output error needs; the factor 2 does not change a search.
            local = {n: schemes[f"layers.{i}.{n}"] for n in mods}
            found = awq.scale_layer(layer, hs, local, routed)
            awq_found.update({f"layers.{i}.{n}": v for n, v in found.items()})
        for local_name, mod in mods.items():
            name, scheme = f"layers.{i}.{local_name}", schemes[f"layers.{i}.{local_name}"]
            if ".experts." in local_name and not torch.any(hs[local_name].diagonal()):  # no token reached it
                # RTN's own grid: without a token there is no output error for a range search to weigh.
                qw = _rtn(mod.weight, scheme, scale_dtype)
                experts[f"layers.{i}"].setdefault("rtn_without_tokens", []).append(local_name)
            elif cfg.method == "awq":
                q, scale, zero = awq.quantize_clipped(mod.weight.float(), hs[local_name], scheme, scale_dtype)
                qw = QuantWeight(q, scale, zero, scheme.num_bits, scheme.group_size)
            else:
                shrink = None
                if cfg.clip == "mse":
                    shrink = awq.search_clip(mod.weight.float(), hs[local_name], scheme,
                                             gptq_clip_shrinks(scheme.num_bits))
                try:
                    q, scale, zero, used = gptq(mod.weight, hs[local_name], scheme, cfg.dampening, cfg.block_size,
                                                cfg.act_order, scale_dtype, shrink)
                except HessianError as e:
                    raise StageError(f"{name}: {e}") from None
                damp_used[name] = used
                qw = QuantWeight(q, scale, zero, scheme.num_bits, scheme.group_size)
            out[name] = qw
            with torch.no_grad():  # later layers calibrate on this layer's quantized outputs
                mod.weight.copy_(qw.dequantize(mod.weight.dtype))
        del hs
        with torch.inference_mode():
            xs = xs.replace(p.layer(i, x) for p, x in zip(passes, xs))
        if on_layer is not None:  # the layer's weights go to the artifact now and are not kept
            on_layer(i, {n: out.pop(f"layers.{i}.{n}") for n in mods})
        layers.free(i)
        log.info("%s layer %d/%d done", cfg.method.upper(), i + 1, len(model.layers))
    return out, damp_used, awq_found, experts


@torch.no_grad()
def _rtn_layers(model, schemes: dict[str, WeightScheme | None], cfg: QuantConfig, scale_dtype: torch.dtype,
                layers=ResidentLayers(), on_layer=None) -> dict[str, QuantWeight]:
    """Round to nearest, decoder layer by decoder layer (read in and released by `layers`)."""
    out: dict[str, QuantWeight] = {}
    for i, layer in enumerate(model.layers):
        layers.load(i)
        done = {n: _rtn(layer.get_submodule(n).weight, schemes[f"layers.{i}.{n}"], scale_dtype, cfg.clip)
                for n, _ in fused_linears(model.config, i) if schemes.get(f"layers.{i}.{n}")}
        if on_layer is not None:  # the layer's weights go to the artifact now and are not kept
            on_layer(i, done)
        else:
            out.update({f"layers.{i}.{n}": qw for n, qw in done.items()})
        layers.free(i)
    return out


def _autoround_layers(model, samples: list[list[int]], schemes: dict[str, WeightScheme | None], cfg: QuantConfig,
                      scale_dtype: torch.dtype, layers=ResidentLayers(), on_layer=None
                      ) -> tuple[dict[str, QuantWeight], dict]:
    """AutoRound, decoder layer by decoder layer (quantize/autoround.py): two streams of
    activations, the quantized model's (each layer's input) and the unquantized model's (its
    target), one layer's worth of each held at a time. Returns the quantized weights and each
    layer's report. `layers` and `on_layer` as for `_layerwise` (the activations stay in memory:
    the steps draw mini-batches from them at random)."""
    from quantpipe.runtime.llm_engine import resolve_dtype

    learn_dtype = resolve_dtype(cfg.learn_dtype, torch.device("cpu"))
    passes = [SequencePass(model, ids) for ids in samples]
    with torch.no_grad():  # not inference_mode: these activations feed the gradient steps
        xq = [p.embed() for p in passes]
    xf = xq
    out: dict[str, QuantWeight] = {}
    report: dict[str, dict] = {}
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:  # only the rounding parameters take gradients
        p.requires_grad_(False)
    try:
        for i in range(len(model.layers)):
            t = time.perf_counter()
            layers.load(i)
            local = {n: schemes[f"layers.{i}.{n}"] for n, _ in fused_linears(model.config, i)
                     if schemes.get(f"layers.{i}.{n}")}
            with torch.no_grad():
                ys = [p.layer(i, x) for p, x in zip(passes, xf)]
            if local:
                found = autoround.round_layer(model, i, local, samples, xq, ys, cfg.iters, cfg.batch_size,
                                              scale_dtype, learn_dtype)
                for n, qw in found.weights.items():
                    out[f"layers.{i}.{n}"] = qw
                    mod = model.layers[i].get_submodule(n)
                    with torch.no_grad():  # later layers learn on this layer's quantized outputs
                        mod.weight.copy_(qw.dequantize(mod.weight.dtype))
                report[f"layers.{i}"] = {k: round(v, 8) if isinstance(v, float) else v for k, v in found.report.items()}
                log.info("AutoRound layer %d/%d in %.1fs: output error %.3g at round-to-nearest, %s learned",
                         i + 1, len(model.layers), time.perf_counter() - t, found.report["error_nearest"],
                         "none" if found.report["error_learned"] is None else f"{found.report['error_learned']:.3g}")
            with torch.no_grad():
                xq = [p.layer(i, x) for p, x in zip(passes, xq)]
            xf = ys
            if on_layer is not None:  # the layer's weights go to the artifact now and are not kept
                on_layer(i, {n: out.pop(f"layers.{i}.{n}") for n in local})
            layers.free(i)
    finally:
        for p in trainable:
            p.requires_grad_(True)
    return out, report


class _Checkpoint:
    """The artifact's tensors, written group by group as they are ready: the embeddings, each
    decoder layer, lm_head, then the final norm (and static KV scales). Both paths (whole
    model, streamed) write the same groups in the same order, so with the same shard size
    they write the same files."""

    def __init__(self, folder: Path, net, scheme_map: dict, fmt: str, scale_dtype: torch.dtype,
                 max_shard_bytes: int, damp_used: dict, awq_found: dict):
        self.writer = CheckpointWriter(folder, max_shard_bytes)
        self.net, self.scheme_map, self.fmt, self.dtype = net, scheme_map, fmt, scale_dtype
        self.damp_used, self.awq_found = damp_used, awq_found
        self.layers_table: dict[str, dict] = {}
        self.by_scheme: dict[WeightScheme, list[str]] = {}
        self.quant_bytes = self.bf16_bytes = 0

    def add(self, prefix, quantized: dict[str, QuantWeight], extra: dict[str, torch.Tensor] | None = None) -> None:
        """Our tensors whose names start with `prefix` (the net's, in the artifact dtype) with the
        Linears in `quantized` (our names) in the artifact's format, plus `extra` (checkpoint
        names, as they are), as one group."""
        state = {k: v.to(self.dtype) for k, v in hf_state_dict(self.net, prefix).items()}
        state.update(extra or {})
        for name, qw in quantized.items():
            parts = _hf_parts(self.net, name)
            sizes = [s if s is not None else qw.q.shape[0] for _, s in parts]
            for (hf_name, _), part in zip(parts, _split_rows(qw, sizes)):
                state.pop(hf_name + ".weight", None)
                tensors = quantized_tensors(hf_name, part, self.fmt, self.dtype)
                state.update(tensors)
                self.quant_bytes += sum(t.numel() * t.element_size() for k, t in tensors.items()
                                        if not k.endswith("weight_shape"))
                self.bf16_bytes += 2 * part.q.numel()
                self.layers_table[hf_name] = {"scheme": self.scheme_map[name].describe(), "shape": list(part.q.shape),
                                              "dampening": self.damp_used.get(name)}
                if name in self.awq_found:
                    self.layers_table[hf_name]["awq"] = self.awq_found[name]
                self.by_scheme.setdefault(self.scheme_map[name], []).append(hf_name)
        self.writer.add(state)

    def add_layer(self, i: int, quantized: dict[str, QuantWeight]) -> None:
        """Decoder layer i; `quantized` by the layer's local names."""
        self.add(f"layers.{i}.", {f"layers.{i}.{n}": qw for n, qw in quantized.items()})


def _copy_rows(ckpt: _Checkpoint, lazy, name: str, hf_name: str, transform=None) -> None:
    """An unquantized matrix (the embeddings, lm_head) from the source into the checkpoint, read
    in row ranges and converted range by range: never whole in float32, and never whole at all
    when it is larger than a shard. `transform` maps each range's float32 rows first (R1)."""
    def chunks():
        for rows in lazy.row_ranges(name):
            if transform is None:
                yield lazy.get(name, ckpt.dtype, rows=rows)
            else:
                yield transform(lazy.get(name, torch.float32, rows=rows)).to(ckpt.dtype)
            lazy.release()

    ckpt.writer.add_rows(hf_name, list(lazy.shape(name)), ckpt.dtype, chunks)


def _compact_embedding(net, lazy, samples: list[list[int]], transform=None) -> list[list[int]]:
    """Streamed calibration: the embedding holds only the rows of the tokens in `samples`
    (float32, read in row ranges, mapped by `transform` when given); returns the samples
    renumbered into those rows."""
    used = sorted({t for s in samples for t in s})
    rows, cols = lazy.shape("embed_tokens.weight")
    if used and not (0 <= used[0] and used[-1] < rows):
        bad = used[0] if used[0] < 0 else used[-1]
        raise StageError(f"calibration token id {bad} is outside the model's vocabulary of {rows} tokens")
    index = torch.tensor(used, dtype=torch.long)
    compact = torch.empty(len(used), cols)
    for a, b in lazy.row_ranges("embed_tokens.weight"):
        lo, hi = torch.searchsorted(index, a), torch.searchsorted(index, b)
        if hi > lo:
            compact[lo:hi] = lazy.get("embed_tokens.weight", rows=(a, b))[index[lo:hi] - a]
            lazy.release()
    if transform is not None:
        compact = transform(compact)
    net.embed_tokens.weight = torch.nn.Parameter(compact, requires_grad=False)
    renumber = {t: k for k, t in enumerate(used)}
    return [[renumber[t] for t in s] for s in samples]


STREAMED_METHODS = ("rtn", "gptq", "awq", "autoround")


def _streamable(cfg: QuantConfig) -> None:
    """Refuse what layer-streamed quantization does not do yet, before any file is read."""
    if cfg.method not in STREAMED_METHODS:
        raise StageError(f"--max-memory (layer-streamed quantization) takes method {', '.join(STREAMED_METHODS)}; "
                         f"got {cfg.method}")
    why = ("mixed precision (its sensitivities need the whole model's output)" if cfg.scheme == "mixed" else
           "SmoothQuant (use --no-smoothquant)" if cfg.scheme == "W8A8" and cfg.smoothquant_alpha is not None else
           "static KV cache scales (use --kv-cache-strategy token)"
           if cfg.kv_cache != "none" and cfg.kv_cache_strategy == "channel" else None)
    if why:
        raise StageError(f"--max-memory (layer-streamed quantization) does not take {why} yet")


def _memory_plan(net, mcfg, names: list[str], samples: list[list[int]], cfg: QuantConfig, budget: int,
                 shard_bytes: int, scale_dtype: torch.dtype, lazy, rotating: bool) -> MemoryPlan:
    """What the streamed run will hold at its peak (stream.plan_memory checks it against the budget)."""
    layer_bytes = max(sum(4 * p.numel() for p in layer.parameters()) for layer in net.layers)
    linears = [net.get_submodule(n) for n in names if n != "lm_head"]
    largest = max(4 * m.weight.numel() for m in linears)
    if rotating:  # a rotation's float64 operand and product of the largest Linear, beyond the 3 copies below
        layer_bytes += largest
    hess = 0
    if cfg.method in ("gptq", "awq"):
        hess = max(sum(12 * net.get_submodule(f"layers.{i}.{n}").in_features ** 2 for n, _ in fused_linears(mcfg, i))
                   for i in range(mcfg.num_layers))
    activations = 4 * mcfg.hidden_size * sum(map(len, samples)) if cfg.method != "rtn" else 0
    if cfg.method == "autoround":  # two streams (inputs and targets), each with the next layer's
        activations *= 2
    # The checkpoint shard being filled (a decoder layer larger than a shard is held alone); the
    # embeddings and lm_head go through in row ranges when larger than a shard (else they
    # join it), and a quantized lm_head is rounded whole in float32.
    item = torch.empty(0, dtype=scale_dtype).element_size()
    held = [shard_bytes, max(item * sum(p.numel() for p in layer.parameters()) for layer in net.layers)]
    held.append(ROW_RANGE_BYTES + (4 * math.prod(lazy.shape("lm_head.weight")) if "lm_head" in names else 0))
    return plan_memory(budget, layer_bytes, largest, hess, activations, max(1, len(samples)), max(held),
                       spill=cfg.method != "autoround")


def quantize(model: str | None, cfg: QuantConfig, calib: str | None, out: str, overwrite: bool = False,
             calib_token_ids: list[list[int]] | None = None, sensitivity_from: str | None = None,
             max_memory: int | None = None, max_shard_size: int | None = None) -> Artifact:
    """Quantize `model` (GGUF, HF folder, or None for the default model) into the artifact folder `out`.

    `calib` is a `quantpipe calibrate` folder or a text file; `calib_token_ids` gives token
    sequences directly instead (for models without a tokenizer). `sensitivity_from`, an
    earlier mixed-precision artifact: its sensitivity table is reused when it was measured on
    the same model, probe sequences and precisions (its manifest says so), else measured again.
    `max_memory` (bytes): quantize one decoder layer at a time within this resident memory
    (stream.py), for models larger than memory. `max_shard_size` (bytes): the largest
    safetensors file written [default 5 GB; streamed: also at most max_memory / 8].
    """
    from quantpipe.runtime.model.loader import load_model, open_lazy, resolve_model_path, skeleton

    t_start = time.perf_counter()
    phases: dict[str, float] = {}
    if Path(out).exists() and not overwrite:
        raise StageError(f"--out {out} already exists (pass --overwrite to replace it)")
    streamed = max_memory is not None
    if streamed:
        _streamable(cfg)
        map_large_allocations()
        reset_peak()
    if max_shard_size is None:
        max_shard_size = DEFAULT_MAX_SHARD_BYTES if not streamed else min(DEFAULT_MAX_SHARD_BYTES, max_memory // 8)
    earlier = None
    if sensitivity_from is not None:
        if cfg.scheme != "mixed":
            raise StageError(f"--sensitivity-from applies to --scheme mixed only (got {cfg.scheme})")
        earlier = read_manifest(sensitivity_from, "--sensitivity-from")
    lazy = None
    try:
        src = resolve_model_path(model)
        if streamed:
            lazy = open_lazy(model)
            mcfg, tokenizer = lazy.config, lazy.tokenizer
            net = skeleton(mcfg, lazy)
        else:
            net, mcfg, tokenizer = load_model(model, torch.float32)
    except (ValueError, FileNotFoundError) as e:
        raise StageError(f"model: {e}") from None
    src_sha = model_sha256(src)
    phases["load_s"] = time.perf_counter() - t_start
    if mcfg.moe_layers and cfg.scheme == "W8A8" and cfg.smoothquant_alpha is not None:
        # Its migration would fold into the norm that feeds the router and every expert, which is built for AWQ only.
        raise StageError(f"SmoothQuant is not supported on mixture-of-experts models ({mcfg.architecture}) yet: "
                         f"use --no-smoothquant")
    names = [f"layers.{i}.{n}" for i in range(mcfg.num_layers) for n, _ in fused_linears(mcfg, i)]
    if cfg.quantize_lm_head:
        if mcfg.tie_word_embeddings:
            raise StageError("quantize_lm_head: this model ties lm_head to the embeddings, which stay unquantized")
        names.append("lm_head")
    in_features = [net.get_submodule(n).in_features for n in names]
    scheme = cfg.weight_scheme(in_features)
    if scheme.group_size:
        for n, k in zip(names, in_features):
            if k % scheme.group_size:
                # No padding option: compressed-tensors (and so vLLM) refuse groups that do not tile the row.
                fits = [g for g in (128, 64, 32) if all(x % g == 0 for x in in_features)]
                raise StageError(f"group_size {scheme.group_size} does not divide the input size {k} of {n}; "
                                 f"group sizes that divide every layer here: {', '.join(map(str, fits)) or 'none'}")
    scale_dtype = getattr(torch, cfg.dtype)

    texts, calib_info = calibration_texts(calib)
    t = time.perf_counter()
    damp_used: dict[str, float] = {}
    smoothing = None
    w8a8 = cfg.scheme == "W8A8"
    static_kv = cfg.kv_cache != "none" and cfg.kv_cache_strategy == "channel"
    awq_found: dict[str, dict] = {}
    experts: dict[str, dict] = {}
    rounding = None  # autoround: each decoder layer's output error before and after learning
    what = cfg.calibration_need()
    samples: list[list[int]] = []
    if what:
        if calib_token_ids is not None:
            samples = [list(s)[: cfg.calib_seq_len] for s in calib_token_ids[: cfg.calib_samples]]
            calib_info = {"kind": "token_ids", "sha256": sha256_bytes(json.dumps(samples).encode())}
        elif calib is None:
            raise StageError(f"--calib: {what} needs calibration data (a quantpipe calibrate set or a text file)")
        elif tokenizer is None:
            raise StageError(f"model: {what} needs the model's tokenizer to encode the calibration texts")
        else:
            samples = _token_samples(texts, tokenizer, cfg)
    if cfg.method in ("gptq", "awq"):
        need = 2 * max(in_features)
        got = sum(map(len, samples))
        if got < need:
            raise StageError(f"--calib {calib}: {got} calibration tokens; {cfg.method.upper()} needs at least {need} "
                             f"(2 x the largest input size {max(in_features)}) to estimate its Hessians")
    rotator = None
    rotations = cfg.rotations_for(rotate.takes(mcfg, cfg.hadamard_block_size))
    if rotations:  # before anything is measured on the model: calibration sees the rotated one
        rotator = rotate.Rotator(mcfg, rotations, cfg.hadamard_block_size)
        mcfg = rotator.untie(net)  # R1 on a tied model: lm_head becomes a matrix of its own
        if not streamed:  # else each layer as it is read in, the embeddings and lm_head as they are copied
            rotator.whole(net)
            phases["rotate_s"] = time.perf_counter() - t
            t = time.perf_counter()
    fold = rotator.embedding if rotator is not None and rotator.r1 else None  # streamed embeddings
    kv_scales = None
    if static_kv:  # on the unquantized model, before any weight is changed
        from quantpipe.quantize.kv import static_kv_scales

        kv_scales = static_kv_scales(net, samples, cfg.kv_cache)
        phases["kv_scales_s"] = time.perf_counter() - t
        t = time.perf_counter()
    if w8a8 and cfg.smoothquant_alpha is not None:
        smoothing = smooth(net, samples, cfg.smoothquant_alpha)
        phases["smooth_s"] = time.perf_counter() - t
        t = time.perf_counter()
    scheme_map: dict[str, WeightScheme | None] = {n: scheme for n in names}
    sensitivity = None
    if cfg.scheme == "mixed":
        from quantpipe.quantize import mixed

        measured = cfg.mixed_candidates(scheme.group_size)
        cands = [mixed.KEEP, *measured]
        inf = {n: k for n, k in zip(names, in_features)}
        params = {n: net.get_submodule(n).weight.numel() for n in names}
        floor = mixed.average_bits(params, inf, mixed.cheapest(inf, cands))
        if cfg.bits_budget < floor:  # before minutes of measuring
            raise StageError(f"bits_budget {cfg.bits_budget} is below {floor:.4g} bits per weight, the cheapest "
                             f"assignment with mixed_bits {list(cfg.mixed_bits)} and group sizes "
                             f"{sorted({s.group_size for s in measured if s.group_size})} where they divide each "
                             f"layer's input")
        probe = [s[: cfg.sensitivity_tokens] for s in samples[: cfg.sensitivity_samples]]
        key = mixed.measure_key(src_sha, probe, measured)
        sens, reused = None, None
        if earlier is not None:
            sens, why = mixed.reusable(earlier.get("mixed_precision"), key, inf, measured)
            if sens is None:
                log.info("measuring sensitivities: --sensitivity-from %s is not reusable: %s", sensitivity_from, why)
            else:
                reused = {"artifact": os.path.basename(os.path.normpath(sensitivity_from)),
                          "artifact_sha256": earlier.get("artifact_sha256")}
        if sens is None:
            sens = mixed.sensitivities(net, names, measured, probe)
        try:
            scheme_map = mixed.assign(params, inf, sens, cands, cfg.bits_budget)
        except ValueError as e:
            raise StageError(f"mixed precision: {e}") from None
        avg = mixed.average_bits(params, inf, scheme_map)
        sensitivity = {"table": sens, "measured_on": key, "reused_from": reused, "bits_budget": cfg.bits_budget,
                       "average_bits": round(avg, 4),
                       "chosen": {n: (s.describe() if s else "bf16") for n, s in scheme_map.items()}}
        odd = sorted({s.num_bits for s in scheme_map.values() if s is not None} - {4, 8})
        if odd:
            log.warning("mixed precision chose %s-bit layers: quantpipe serves them, vLLM's compressed-tensors "
                        "weight-only path takes 4 and 8 bits only", "/".join(map(str, odd)))
        phases["sensitivity_s"] = time.perf_counter() - t
        t = time.perf_counter()
    memory = None
    if streamed:
        plan = _memory_plan(net, mcfg, names, samples, cfg, max_memory, max_shard_size, scale_dtype, lazy,
                            rotating=rotator is not None)
        memory = {"streamed": True, "max_memory_mib": mib(max_memory), "max_shard_mib": mib(max_shard_size),
                  "plan": plan.describe()}
        log.info("layer-streamed: plan %s", plan.describe())
    fmt = "int-quantized" if w8a8 else "pack-quantized"
    with staged_output(out, overwrite=overwrite) as tmp, contextlib.ExitStack() as scratch:
        ckpt = _Checkpoint(tmp, net, scheme_map, fmt, scale_dtype, max_shard_size, damp_used, awq_found)
        layers, on_layer, spill, run_samples = ResidentLayers(), None, None, samples
        if streamed:
            layers = StreamedLayers(net, lazy, max_memory, on_load=rotator.layer if rotator is not None else None)
            on_layer = ckpt.add_layer
            _copy_rows(ckpt, lazy, "embed_tokens.weight", "model.embed_tokens.weight", fold)
            if samples:
                run_samples = _compact_embedding(net, lazy, samples, fold)
            if plan.on_disk:
                spill = Path(scratch.enter_context(spill_folder(out)))
        if cfg.method in ("gptq", "awq"):
            calib_info["samples"], calib_info["tokens"] = len(samples), sum(map(len, samples))
            quantized, damp_used, awq_found, experts = _layerwise(net, run_samples, scheme_map, cfg, scale_dtype,
                                                                  layers, on_layer, spill, damp_used, awq_found)
        elif cfg.method == "autoround":
            calib_info["samples"], calib_info["tokens"] = len(samples), sum(map(len, samples))
            quantized, rounding = _autoround_layers(net, run_samples, scheme_map, cfg, scale_dtype, layers, on_layer)
        else:
            quantized = _rtn_layers(net, scheme_map, cfg, scale_dtype, layers, on_layer)
        head_fold = None  # streamed, untied R1: lm_head's rows as they are copied
        if streamed:
            net.norm.load_state_dict({"weight": lazy.get("norm.weight")}, assign=True)
            if "lm_head" in names:
                net.lm_head.load_state_dict({"weight": lazy.get("lm_head.weight")}, assign=True)
            if fold is not None:
                head_fold = rotator.fold_final_norm(net)
                if "lm_head" in names:
                    with torch.no_grad():
                        net.lm_head.weight.copy_(head_fold(net.lm_head.weight))
        if scheme_map.get("lm_head"):  # RTN's grid whatever the method (min-max but for --method rtn --clip mse)
            quantized["lm_head"] = _rtn(net.lm_head.weight, scheme_map["lm_head"], scale_dtype,
                                        cfg.clip if cfg.method == "rtn" else "minmax")
        phases["quantize_s"] = time.perf_counter() - t

        # -- the checkpoint: unfused HF names, packed integers, scales in the artifact dtype ----
        t = time.perf_counter()
        if not streamed:
            ckpt.add("embed_tokens.", {})
            for i in range(mcfg.num_layers):
                ckpt.add_layer(i, {n: quantized[f"layers.{i}.{n}"] for n, _ in fused_linears(mcfg, i)
                                   if f"layers.{i}.{n}" in quantized})
        if "lm_head" in quantized or not streamed:  # the net's lm_head: quantized, or as it is (none when tied)
            ckpt.add("lm_head.", {"lm_head": quantized["lm_head"]} if "lm_head" in quantized else {})
        elif not mcfg.tie_word_embeddings:  # an untied copy of tied embeddings reads the embeddings
            source = "embed_tokens.weight" if rotator is not None and rotator.untied else "lm_head.weight"
            _copy_rows(ckpt, lazy, source, "lm_head.weight", head_fold)
        rotated = rotator.result() if rotator is not None else None
        ckpt.add("norm.", {}, kv_scale_tensors(kv_scales or []) | (rotated.tensors if rotated else {}))
        kept = ([] if "lm_head" in names else ["lm_head"]) + ["model." + checkpoint_name(mcfg, r) for r in routers(mcfg)]
        kept += [hf for n in names if scheme_map[n] is None for hf, _ in _hf_parts(net, n)]
        act_args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                    "group_size": None, "observer": None} if w8a8 else None

        def weight_args(sch: WeightScheme) -> dict:
            return {"num_bits": sch.num_bits, "type": "int", "symmetric": sch.symmetric,
                    "strategy": "group" if sch.group_size else "channel", "group_size": sch.group_size,
                    "dynamic": False, "actorder": "weight" if cfg.act_order and cfg.method == "gptq" else None,
                    "observer": "mse" if cfg.clip == "mse" else "minmax", "block_structure": None}

        if cfg.scheme == "mixed":  # one group per precision, each naming its modules
            groups = {f"group_{i}": {"targets": [f"re:^{re.escape(n)}$" for n in mods], "weights": weight_args(sch),
                                     "input_activations": None, "output_activations": None, "format": fmt}
                      for i, (sch, mods) in enumerate(sorted(ckpt.by_scheme.items(), key=lambda kv: kv[0].num_bits))}
        else:
            groups = {"group_0": {"targets": ["Linear"], "weights": weight_args(scheme), "input_activations": act_args,
                                  "output_activations": None, "format": fmt}}
        qconfig = {
            "quant_method": "compressed-tensors", "format": "mixed-precision" if cfg.scheme == "mixed" else fmt,
            "quantization_status": "compressed", "config_groups": groups,
            "ignore": kept, "kv_cache_scheme": cfg.kv_cache_scheme(), "global_compression_ratio": None,
        }
        if rotated:
            qconfig["transform_config"] = rotated.transform_config
        config = hf_config(mcfg, scale_dtype)
        config["quantization_config"] = qconfig
        kept_bytes = sum(2 * net.get_submodule(n).weight.numel() for n in names if scheme_map[n] is None)
        quant_bytes, bf16_bytes = ckpt.quant_bytes + kept_bytes, ckpt.bf16_bytes + kept_bytes  # mixed: bf16 layers
        ckpt.writer.close(config)
        if tokenizer is not None:
            export_tokenizer(tokenizer, str(tmp))
        phases["write_s"] = time.perf_counter() - t
        peak = resident_bytes()[1]
        if memory is not None:
            memory["peak_rss_mib"] = mib(peak)
            if peak > max_memory:
                raise StageError(f"--max-memory {mib(max_memory)} MiB: the process's resident memory reached "
                                 f"{mib(peak)} MiB (the plan's estimate was {plan.describe()['estimate_mib']} MiB); "
                                 f"nothing was written")
        manifest = {
            "stage": "quantize", "manifest_version": MANIFEST_VERSION, "code_version": code_version(),
            "source_model": {"path": os.path.basename(os.path.normpath(src)), "sha256": src_sha,
                             "architecture": mcfg.architecture},
            "scheme": cfg.scheme, "weights": "mixed" if cfg.scheme == "mixed" else scheme.describe(),
            "method": cfg.method, "parameters": cfg.to_dict(),
            "group_size": scheme.group_size, "calibration": calib_info, "layers": ckpt.layers_table,
            "activations": "int8 per token, dynamic" if w8a8 else None, "smoothquant": smoothing,
            "kv_cache": None if cfg.kv_cache == "none" else
            f"{cfg.kv_cache} static per KV head and channel (calibrated)" if static_kv else
            f"{cfg.kv_cache} per token and KV head, dynamic",
            "mixed_precision": sensitivity,
            "experts": experts or None,  # MoE with GPTQ: tokens routed to each expert, per layer
            "autoround": rounding,
            "rotations": rotated.summary if rotated else None,
            "bytes": {"quantized_linears": int(quant_bytes), "bf16_equivalent": int(bf16_bytes),
                      "ratio": round(quant_bytes / max(1, bf16_bytes), 4)},
            "max_shard_bytes": max_shard_size,  # the files (and so artifact_sha256) depend on it
            "memory": memory,
            "time_s": {k: round(v, 2) for k, v in phases.items()},
            "peak_rss_mib": mib(peak),
        }
        manifest = seal(tmp, manifest)
    log.info("quantized %d linears (%s, %s) into %s in %.1fs", len(ckpt.layers_table), manifest["weights"],
             cfg.method, out, time.perf_counter() - t_start)
    return Artifact(Path(out), manifest)
