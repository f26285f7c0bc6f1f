"""Artifacts end to end on small random models of every supported architecture: quantize,
save, read back with the compressed-tensors library, load in the runtime, generate, and
match HF transformers running the library's decompressed weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantpipe.manifest import StageError
from quantpipe.quantize import QuantConfig, quantize
from quantpipe.runtime import LLM, SamplingParams
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model
from tests.model.test_parity_architectures import ARCHS, build

pytest.importorskip("compressed_tensors")

IDS = [3, 17, 250, 99, 4, 4, 120, 300, 7, 64, 12, 200, 31, 9, 150, 42]


def hf_reference_logits(artifact: str) -> torch.Tensor:
    """HF transformers on the weights compressed-tensors decompresses from the artifact."""
    import transformers
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg = json.load(open(f"{artifact}/config.json"))
    qcfg = QuantizationConfig.model_validate(cfg.pop("quantization_config"))
    scheme = qcfg.config_groups["group_0"]
    state = load_file(f"{artifact}/model.safetensors")
    modules = {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")}
    for m in modules:
        local = {t: state.pop(f"{m}.{t}") for t in ("weight_packed", "weight_scale", "weight_shape",
                                                   "weight_zero_point") if f"{m}.{t}" in state}
        state[f"{m}.weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    if hf_cfg.tie_word_embeddings:
        model.tie_weights()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float()


SCHEMES = {
    "w4-g32-sym": (QuantConfig(scheme="W4A16", group_size=32, dtype="float32"), "int4pack"),
    "w4-g64-asym": (QuantConfig(scheme="W4A16", group_size=64, symmetric=False, dtype="float32"), "int4pack"),
    "w8-channel": (QuantConfig(scheme="W8A16", dtype="float32"), "int8pack"),
    "w8-g32-asym": (QuantConfig(scheme="W8A16", group_size=32, symmetric=False, dtype="float32"), "dequant"),
}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantize_load_generate_and_match_reference(tmp_path, arch, name):
    _, src = build(tmp_path, arch)
    cfg, kernel = SCHEMES[name]
    out = str(tmp_path / "artifact")
    art = quantize(src, cfg, None, out)
    assert art.manifest["layers"] and art.manifest["source_model"]["sha256"]
    ref = hf_reference_logits(out)
    # The format picks the kernel for bf16 activations (the int kernels' fast case)...
    bf16, _, _ = load_model(out, torch.bfloat16)
    assert {type(m).kernel for m in bf16.modules() if hasattr(m, "kernel")} == {kernel}
    # ... and every path computes the same function (checked in float32).
    for force in {kernel, "dequant"}:
        model, _, _ = load_model(out, torch.float32, quant_kernel=force)
        assert {type(m).kernel for m in model.modules() if hasattr(m, "kernel")} == {force}
        got = sequence_logits(model, IDS)
        assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (force, (got - ref).abs().max())
    llm = LLM(model=out, dtype="float32", kv_cache_memory="16MiB")
    text = llm.generate([IDS], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(text.outputs[0].token_ids) == 8
    llm.engine.pool.check_invariants()


def test_gptq_on_a_small_model_from_token_ids(tmp_path):
    _, src = build(tmp_path, "llama-gqa-untied-llama3-rope")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 320, (64,), generator=g).tolist() for _ in range(16)]
    art = quantize(src, QuantConfig(scheme="W4A16", group_size=32, method="gptq", calib_samples=16),
                   None, str(tmp_path / "gptq"), calib_token_ids=ids)
    assert art.manifest["calibration"]["kind"] == "token_ids"
    assert all(v["dampening"] == 0.01 for v in art.manifest["layers"].values() if "lm_head" not in v)
    model, _, _ = load_model(str(tmp_path / "gptq"), torch.float32)
    assert torch.isfinite(sequence_logits(model, IDS)).all()


# -- bad input ---------------------------------------------------------------------------

def test_bad_input_is_refused_and_leaves_nothing(tmp_path):
    _, src = build(tmp_path, "llama-tied")
    with pytest.raises(StageError, match="group_size 128 does not divide the input size 64 of layers.0"):
        quantize(src, QuantConfig(scheme="W4A16", group_size=128), None, str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    with pytest.raises(StageError, match="group_size must be one of 32, 64, 128"):
        QuantConfig(group_size=48)
    with pytest.raises(StageError, match="scheme must be one of W8A16, W4A16, W8A8"):
        QuantConfig(scheme="W3A16")
    with pytest.raises(StageError, match="ties lm_head"):
        quantize(src, QuantConfig(quantize_lm_head=True), None, str(tmp_path / "b"))
    with pytest.raises(StageError, match="GPTQ needs at least 256"):
        quantize(src, QuantConfig(method="gptq", group_size=32), None, str(tmp_path / "c"),
                 calib_token_ids=[[1, 2, 3, 4, 5, 6, 7, 8]])
    (tmp_path / "d").mkdir()
    with pytest.raises(StageError, match="already exists"):
        quantize(src, QuantConfig(group_size=32), None, str(tmp_path / "d"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_corrupt_artifact_is_refused_naming_the_tensor(tmp_path):
    _, src = build(tmp_path, "mistral")
    out = str(tmp_path / "art")
    quantize(src, QuantConfig(scheme="W4A16", group_size=32), None, out)
    state = load_file(f"{out}/model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_packed"
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, f"{out}/model.safetensors")
    with pytest.raises(ValueError, match=name):
        load_model(out, torch.float32)
