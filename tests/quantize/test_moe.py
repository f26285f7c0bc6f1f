"""Mixture-of-experts quantization on small random Qwen3-MoE and Mixtral models: artifacts
that compressed-tensors and HF transformers read back, GPTQ with each expert's own Hessian,
AWQ's scales across experts, and the report of which experts the calibration tokens reached."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantpipe.manifest import StageError
from quantpipe.quantize import QuantConfig, quantize
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model
from tests.model.test_parity_architectures import build

W4 = dict(scheme="W4A16", group_size=32, dtype="float32")


def token_ids(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(320) for _ in range(length)] for _ in range(n)]


def decompressed_hf_logits(artifact, tmp_path, ids) -> torch.Tensor:
    """HF transformers (through from_pretrained, which reads per-expert checkpoints) on the
    weights the compressed-tensors library decompresses from the artifact."""
    import transformers
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg = json.load(open(f"{artifact}/config.json"))
    qcfg = QuantizationConfig.model_validate(cfg.pop("quantization_config"))
    state = load_file(f"{artifact}/model.safetensors")
    for m in {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")}:
        local = {t: state.pop(f"{m}.{t}") for t in ("weight_packed", "weight_scale", "weight_shape",
                                                   "weight_zero_point") if f"{m}.{t}" in state}
        state[f"{m}.weight"] = PackedQuantizationCompressor.decompress(local, qcfg.config_groups["group_0"])["weight"]
    plain = tmp_path / "decompressed"
    plain.mkdir()
    save_file({k: v.float().contiguous() for k, v in state.items()}, plain / "model.safetensors")
    (plain / "config.json").write_text(json.dumps(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_experts_quantize_into_an_artifact_that_compressed_tensors_and_hf_read(tmp_path, arch):
    _, src = build(tmp_path, arch)
    out = tmp_path / "artifact"
    art = quantize(src, QuantConfig(**W4), None, str(out))
    cfg = json.load(open(out / "config.json"))
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    expert_up = "w3" if arch == "mixtral" else "up_proj"
    layer = 1 if arch == "qwen2-moe" else 0  # the small Qwen2-MoE's layer 0 is dense
    assert f"model.layers.{layer}.{moe}.experts.3.{expert_up}" in art.manifest["layers"]
    assert f"model.layers.{layer}.{moe}.gate" in cfg["quantization_config"]["ignore"]  # routers stay high precision
    if arch == "qwen2-moe":  # the shared expert is quantized, its gate is not
        assert "model.layers.1.mlp.shared_expert.down_proj" in art.manifest["layers"]
        assert "model.layers.1.mlp.shared_expert_gate" in cfg["quantization_config"]["ignore"]
    assert not any(k.startswith(f"model.layers.0.{moe}.gate.") and k.endswith("_packed")
                   for k in load_file(out / "model.safetensors"))
    ids = token_ids(1, 24, 5)[0]
    ref = decompressed_hf_logits(out, tmp_path, ids)
    model, _, _ = load_model(str(out), torch.float32)
    got = sequence_logits(model, ids)
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (got - ref).abs().max()


def mean_logit_error(model, base, texts) -> float:
    return sum(float(((sequence_logits(model, t) - sequence_logits(base, t)) ** 2).mean()) for t in texts) / len(texts)


def against_rtn(tmp_path, src: str, method: str, calib: list[list[int]]):
    """(the `method` artifact, its config, the source model, {method, rtn: held-out mean
    squared logit error against the source})."""
    art = quantize(src, QuantConfig(**W4, method=method, calib_samples=len(calib), calib_seq_len=len(calib[0])),
                   None, str(tmp_path / method), calib_token_ids=calib)
    quantize(src, QuantConfig(**W4), None, str(tmp_path / "rtn"))
    base, cfg, _ = load_model(src, torch.float32)
    heldout = token_ids(6, 48, 1)
    errors = {name: mean_logit_error(load_model(str(tmp_path / name), torch.float32)[0], base, heldout)
              for name in (method, "rtn")}
    return art, cfg, base, errors


def test_gptq_with_each_experts_hessian_beats_rtn_and_reports_what_the_router_sent(tmp_path):
    _, src = build(tmp_path, "qwen3-moe")
    calib = token_ids(24, 64, 0)
    gptq, cfg, base, errors = against_rtn(tmp_path, src, "gptq", calib)
    assert errors["gptq"] < errors["rtn"], errors
    # A hand count of layer 0's routing on the calibration tokens (layer 0 sees them before anything is quantized).
    counts = torch.zeros(cfg.num_experts, dtype=torch.long)
    moe = base.layers[0].mlp


    def count(module, args):
        counts.add_(torch.bincount(module.route(args[0])[1].flatten(), minlength=cfg.num_experts))

    handle = moe.register_forward_pre_hook(count)
    for ids in calib:
        sequence_logits(base, ids)
    handle.remove()
    report = gptq.manifest["experts"]
    assert set(report) == {"layers.0"}  # layer 1 is dense
    assert report["layers.0"]["tokens_per_expert"] == counts.tolist()
    assert sum(counts.tolist()) == 2 * 24 * 64  # two experts per token
    floor = report["layers.0"]["floor"]
    assert report["layers.0"]["under_floor"] == [e for e, n in enumerate(counts.tolist()) if n < floor]


def starve_expert_7(tmp_path) -> str:
    """A Qwen3-MoE whose layer-0 router never picks expert 7: the router reads two channels,
    experts 0-6 point in seven directions spread around that plane, expert 7 scores 0; every
    input lies within 90 degrees of at least three of the seven, which outrank it."""
    hf, _ = build(tmp_path, "qwen3-moe")
    layer = hf.model.layers[0]
    with torch.no_grad():
        layer.post_attention_layernorm.weight.zero_()[:2] = 1.0
        w = layer.mlp.gate.weight
        w.zero_()
        angles = torch.arange(7) * (2 * torch.pi / 7)
        w[:7, 0], w[:7, 1] = 5 * angles.cos(), 5 * angles.sin()
    path = tmp_path / "starved"
    hf.save_pretrained(path)
    return str(path)


def test_an_expert_no_calibration_token_reaches_is_reported_and_all_experts_gives_it_a_hessian(tmp_path):
    src = starve_expert_7(tmp_path)
    calib = token_ids(24, 64, 0)
    base = dict(**W4, method="gptq", calib_samples=24, calib_seq_len=64)
    routed = quantize(src, QuantConfig(**base), None, str(tmp_path / "routed"), calib_token_ids=calib)
    everyone = quantize(src, QuantConfig(**base, calibrate_all_experts=True), None, str(tmp_path / "all"),
                        calib_token_ids=calib)
    quantize(src, QuantConfig(**W4), None, str(tmp_path / "rtn"))
    r = routed.manifest["experts"]["layers.0"]
    assert r["tokens_per_expert"][7] == 0 and 7 in r["under_floor"]
    assert r["rtn_without_tokens"] == ["mlp.experts.7.gate_up_proj", "mlp.experts.7.down_proj"]
    a = everyone.manifest["experts"]["layers.0"]
    assert a["tokens_per_expert"] == r["tokens_per_expert"]  # routing is reported as it is
    assert "rtn_without_tokens" not in a and a["hessian_tokens"] == "every token of the layer"
    assert everyone.manifest["parameters"]["calibrate_all_experts"] is True

    def expert7(art: str) -> torch.Tensor:
        model, _, _ = load_model(art, torch.float32, quant_kernel="dequant")
        return model.layers[0].mlp.experts[7].gate_up_proj.weight

    assert torch.equal(expert7(str(tmp_path / "routed")), expert7(str(tmp_path / "rtn")))  # no Hessian: RTN
    assert not torch.equal(expert7(str(tmp_path / "all")), expert7(str(tmp_path / "rtn")))  # GPTQ on all tokens


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_awq_scales_the_experts_beats_rtn_and_hf_reads_the_artifact(tmp_path, arch):
    """AWQ on experts: one scale for every expert's gate/up (searched with each expert's
    error weighted by the tokens routed to it, folded into the norm, the router and a
    shared expert's gate), one per expert's down projection."""
    _, src = build(tmp_path, arch)
    art, cfg, _, errors = against_rtn(tmp_path, src, "awq", token_ids(24, 64, 0))
    assert errors["awq"] < errors["rtn"], errors
    moe, (gate, down) = ("block_sparse_moe", ("w1", "w2")) if arch == "mixtral" else ("mlp", ("gate_proj", "down_proj"))
    layer = cfg.moe_layers[0]
    mlps = [f"experts.{e}" for e in range(cfg.num_experts)] + (["shared_expert"] if arch == "qwen2-moe" else [])
    searched = {m: {p: art.manifest["layers"][f"model.layers.{layer}.{moe}.{m}.{p}"]["awq"] for p in (gate, down)}
                for m in mlps}
    assert len({str(v[gate]) for v in searched.values()}) == 1  # one shared search, the shared expert's included
    assert any(v[gate]["alpha"] > 0 for v in searched.values())
    assert len({v[down]["alpha"] for v in searched.values()}) > 1 or cfg.num_experts == 1  # each expert its own
    # HF transformers on what compressed-tensors decompresses: the folded router and norm are in the artifact.
    ids = token_ids(1, 48, 1)[0]
    ref = decompressed_hf_logits(tmp_path / "awq", tmp_path, ids)
    got = sequence_logits(load_model(str(tmp_path / "awq"), torch.float32)[0], ids)
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (got - ref).abs().max()


def test_smoothquant_is_refused_on_moe_models(tmp_path):
    _, src = build(tmp_path, "mixtral")
    with pytest.raises(StageError, match="SmoothQuant is not supported.*--no-smoothquant"):
        quantize(src, QuantConfig(scheme="W8A8", smoothquant_alpha=0.5), None, str(tmp_path / "b"),
                 calib_token_ids=token_ids(4, 64, 0))
    assert not (tmp_path / "b").exists()
