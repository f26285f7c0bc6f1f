"""`quantize(model, QuantConfig, calib) -> Artifact`: weights onto an integer grid, written as a
compressed-tensors checkpoint the runtime (and vLLM) load.

Fused projections (q/k/v, gate/up) are quantized as one matrix: rows are independent
under both RTN and GPTQ (groups run along the input dimension and GPTQ's error
feedback too), so this equals quantizing each projection alone, and the artifact stores
them unfused under the source checkpoint's names, as vLLM expects.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantpipe.formats.artifact import (
    QuantWeight,
    kv_scale_tensors,
    model_sha256,
    quantized_tensors,
    read_manifest,
    seal,
    write_checkpoint,
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
from quantpipe.quantize import autoround, awq
from quantpipe.quantize.config import QuantConfig
from quantpipe.quantize.gptq import HessianError, gptq
from quantpipe.quantize.rtn import WeightScheme, rtn
from quantpipe.runtime.model.config import checkpoint_name, fused_linears, routers
from quantpipe.runtime.model.export import export_tokenizer, hf_config, hf_state_dict
from quantpipe.runtime.model.forward import SequencePass
from quantpipe.runtime.model.llama import SparseMoE

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
# (H-weighted) before GPTQ fixes its grid. 8 bits: steps of 1% (a 5% step clips too much).
GPTQ_CLIP_SHRINKS = {4: awq.SHRINKS, 8: tuple(1 - 0.01 * i for i in range(21))}


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


def _layerwise(model, samples: list[list[int]], schemes: dict[str, WeightScheme | None], cfg: QuantConfig,
               scale_dtype: torch.dtype) -> tuple[dict[str, QuantWeight], dict, dict]:
    """GPTQ or AWQ, layer by layer: each layer calibrates on inputs that already passed the
    quantized layers before it, and only one layer's activations are held at a time.

    Returns the quantized weights, the dampening GPTQ used per Linear, and AWQ's scale search per Linear.
    """
    passes = [SequencePass(model, ids) for ids in samples]
    with torch.inference_mode():
        xs = [p.embed() for p in passes]
    out: dict[str, QuantWeight] = {}
    damp_used: dict[str, float] = {}
    awq_found: dict[str, dict] = {}
    experts: dict[str, dict] = {}
    for i, layer in enumerate(model.layers):
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
                                             GPTQ_CLIP_SHRINKS[scheme.num_bits])
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
        with torch.inference_mode():
            xs = [p.layer(i, x) for p, x in zip(passes, xs)]
        log.info("%s layer %d/%d done", cfg.method.upper(), i + 1, len(model.layers))
    if schemes.get("lm_head"):
        sch = schemes["lm_head"]
        out["lm_head"] = _rtn(model.lm_head.weight, sch, scale_dtype)
    return out, damp_used, awq_found, experts


def _autoround_layers(model, samples: list[list[int]], schemes: dict[str, WeightScheme | None], cfg: QuantConfig,
                      scale_dtype: torch.dtype) -> tuple[dict[str, QuantWeight], dict]:
    """AutoRound, decoder layer by decoder layer (quantize/autoround.py): two streams of
    activations, the quantized model's (each layer's input) and the unquantized model's (its
    target), one layer's worth of each held at a time. Returns the quantized weights and each
    layer's report."""
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
    finally:
        for p in trainable:
            p.requires_grad_(True)
    if schemes.get("lm_head"):
        out["lm_head"] = _rtn(model.lm_head.weight, schemes["lm_head"], scale_dtype)
    return out, report


def quantize(model: str | None, cfg: QuantConfig, calib: str | None, out: str, overwrite: bool = False,
             calib_token_ids: list[list[int]] | None = None, sensitivity_from: str | None = None) -> Artifact:
    """Quantize `model` (GGUF, HF folder, or None for the default model) into the artifact folder `out`.

    `calib` is a `quantpipe calibrate` folder or a text file; `calib_token_ids` gives token
    sequences directly instead (for models without a tokenizer). `sensitivity_from`, an
    earlier mixed-precision artifact: its sensitivity table is reused when it was measured on
    the same model, probe sequences and precisions (its manifest says so), else measured again.
    """
    from quantpipe.runtime.model.loader import load_model, resolve_model_path

    t_start = time.perf_counter()
    phases: dict[str, float] = {}
    if Path(out).exists() and not overwrite:
        raise StageError(f"--out {out} already exists (pass --overwrite to replace it)")
    earlier = None
    if sensitivity_from is not None:
        if cfg.scheme != "mixed":
            raise StageError(f"--sensitivity-from applies to --scheme mixed only (got {cfg.scheme})")
        earlier = read_manifest(sensitivity_from, "--sensitivity-from")
    try:
        src = resolve_model_path(model)
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

        cands = mixed.candidates(scheme.group_size)
        measured = [c for c in cands if c is not mixed.KEEP]
        probe = [s[: cfg.sensitivity_tokens] for s in samples[: cfg.sensitivity_samples]]
        key = mixed.measure_key(src_sha, probe, measured)
        sens, reused = None, None
        if earlier is not None:
            sens, why = mixed.reusable(earlier.get("mixed_precision"), key, names)
            if sens is None:
                log.info("measuring sensitivities: --sensitivity-from %s is not reusable: %s", sensitivity_from, why)
            else:
                reused = {"artifact": os.path.basename(os.path.normpath(sensitivity_from)),
                          "artifact_sha256": earlier.get("artifact_sha256")}
        if sens is None:
            sens = mixed.sensitivities(net, names, measured, probe)
        params = {n: net.get_submodule(n).weight.numel() for n in names}
        inf = {n: k for n, k in zip(names, in_features)}
        scheme_map = mixed.assign(params, inf, sens, cands, cfg.bits_budget)
        avg = sum(mixed.bits_of(scheme_map[n], inf[n]) * params[n] for n in names) / sum(params.values())
        sensitivity = {"table": sens, "measured_on": key, "reused_from": reused, "bits_budget": cfg.bits_budget,
                       "average_bits": round(avg, 4),
                       "chosen": {n: (s.describe() if s else "bf16") for n, s in scheme_map.items()}}
        phases["sensitivity_s"] = time.perf_counter() - t
        t = time.perf_counter()
    if cfg.method in ("gptq", "awq"):
        need = 2 * max(in_features)
        got = sum(map(len, samples))
        if got < need:
            raise StageError(f"--calib {calib}: {got} calibration tokens; {cfg.method.upper()} needs at least {need} "
                             f"(2 x the largest input size {max(in_features)}) to estimate its Hessians")
        calib_info["samples"], calib_info["tokens"] = len(samples), got
        quantized, damp_used, awq_found, experts = _layerwise(net, samples, scheme_map, cfg, scale_dtype)
    elif cfg.method == "autoround":
        calib_info["samples"], calib_info["tokens"] = len(samples), sum(map(len, samples))
        quantized, rounding = _autoround_layers(net, samples, scheme_map, cfg, scale_dtype)
    else:
        quantized = {}
        for n in names:
            sch = scheme_map[n]
            if sch is None:
                continue
            quantized[n] = _rtn(net.get_submodule(n).weight, sch, scale_dtype, cfg.clip)
    phases["quantize_s"] = time.perf_counter() - t

    # -- the checkpoint: unfused HF names, packed integers, scales in the artifact dtype ----
    t = time.perf_counter()
    state = {k: v.to(scale_dtype) for k, v in hf_state_dict(net).items()}
    layers_table = {}
    fmt = "int-quantized" if w8a8 else "pack-quantized"
    hf_names_by_scheme: dict[WeightScheme, list[str]] = {}
    kept = ([] if "lm_head" in names else ["lm_head"]) + ["model." + checkpoint_name(mcfg, r) for r in routers(mcfg)]
    for name in names:
        qw, sch = quantized.get(name), scheme_map[name]
        if qw is None:
            kept += [hf for hf, _ in _hf_parts(net, name)]
            continue
        parts = _hf_parts(net, name)
        sizes = [s if s is not None else qw.q.shape[0] for _, s in parts]
        for (hf_name, _), part in zip(parts, _split_rows(qw, sizes)):
            state.pop(hf_name + ".weight", None)
            state.update(quantized_tensors(hf_name, part, fmt, scale_dtype))
            layers_table[hf_name] = {"scheme": sch.describe(), "shape": list(part.q.shape),
                                     "dampening": damp_used.get(name)}
            if name in awq_found:
                layers_table[hf_name]["awq"] = awq_found[name]
            hf_names_by_scheme.setdefault(sch, []).append(hf_name)
    state.update(kv_scale_tensors(kv_scales or []))
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
                  for i, (sch, mods) in enumerate(sorted(hf_names_by_scheme.items(), key=lambda kv: kv[0].num_bits))}
    else:
        groups = {"group_0": {"targets": ["Linear"], "weights": weight_args(scheme), "input_activations": act_args,
                              "output_activations": None, "format": fmt}}
    qconfig = {
        "quant_method": "compressed-tensors", "format": "mixed-precision" if cfg.scheme == "mixed" else fmt,
        "quantization_status": "compressed", "config_groups": groups,
        "ignore": kept, "kv_cache_scheme": cfg.kv_cache_scheme(), "global_compression_ratio": None,
    }
    config = hf_config(mcfg, scale_dtype)
    config["quantization_config"] = qconfig
    quant_bytes = sum(state[f"{n}.{t}"].numel() * state[f"{n}.{t}"].element_size() for n in layers_table
                      for t in ("weight_packed", "weight", "weight_scale", "weight_zero_point") if f"{n}.{t}" in state)
    bf16_bytes = sum(2 * int(np.prod(v["shape"])) for v in layers_table.values())
    kept_bytes = sum(2 * net.get_submodule(n).weight.numel() for n in names if scheme_map[n] is None)
    quant_bytes, bf16_bytes = quant_bytes + kept_bytes, bf16_bytes + kept_bytes  # mixed: layers left in bf16
    with staged_output(out, overwrite=overwrite) as tmp:
        write_checkpoint(tmp, state, config)
        if tokenizer is not None:
            export_tokenizer(tokenizer, str(tmp))
        phases["write_s"] = time.perf_counter() - t
        manifest = {
            "stage": "quantize", "manifest_version": MANIFEST_VERSION, "code_version": code_version(),
            "source_model": {"path": os.path.basename(os.path.normpath(src)), "sha256": src_sha,
                             "architecture": mcfg.architecture},
            "scheme": cfg.scheme, "weights": "mixed" if cfg.scheme == "mixed" else scheme.describe(),
            "method": cfg.method, "parameters": cfg.to_dict(),
            "group_size": scheme.group_size, "calibration": calib_info, "layers": layers_table,
            "activations": "int8 per token, dynamic" if w8a8 else None, "smoothquant": smoothing,
            "kv_cache": None if cfg.kv_cache == "none" else
            f"{cfg.kv_cache} static per KV head and channel (calibrated)" if static_kv else
            f"{cfg.kv_cache} per token and KV head, dynamic",
            "mixed_precision": sensitivity,
            "experts": experts or None,  # MoE with GPTQ: tokens routed to each expert, per layer
            "autoround": rounding,
            "bytes": {"quantized_linears": int(quant_bytes), "bf16_equivalent": int(bf16_bytes),
                      "ratio": round(quant_bytes / max(1, bf16_bytes), 4)},
            "time_s": {k: round(v, 2) for k, v in phases.items()},
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        }
        manifest = seal(tmp, manifest)
    log.info("quantized %d linears (%s, %s) into %s in %.1fs", len(layers_table), manifest["weights"], cfg.method,
             out, time.perf_counter() - t_start)
    return Artifact(Path(out), manifest)
