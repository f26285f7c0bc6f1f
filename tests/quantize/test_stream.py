"""Layer-streamed quantization (`--max-memory`): the whole-model path's artifact byte for byte,
from HF folders and GGUF files, with activations in memory or on disk; a budget too small,
or an option the streamed path does not take, is refused before anything is written. A
model larger than the memory limit: tests/quantize/test_stream_memory.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantpipe.manifest import StageError
from quantpipe.quantize import QuantConfig, quantize
from quantpipe.quantize.stream import parse_size
from tests.model.test_parity_architectures import build
from tests.quantize.test_moe import token_ids

GIB = 1024 ** 3


def model_files(path) -> dict[str, bytes]:
    """Every file of an artifact but its manifest (which records timings)."""
    return {f.name: f.read_bytes() for f in sorted(Path(path).iterdir()) if f.name != "quantpipe.json"}


@pytest.mark.parametrize("arch,method,scheme,rotations", [
    ("llama-gqa-untied-llama3-rope", "gptq", "W4A16", ()),  # untied lm_head, act-order, the range search
    ("qwen2-bias", "awq", "W4A16", ()),  # tied embeddings, q/k/v biases, scales folded into norms
    ("gemma3-sliding-window", "rtn", "W8A16", ()),  # Gemma's norms and scaled embedding
    ("qwen3-moe", "gptq", "W8A8", ()),  # experts, routers kept; W8A8 without SmoothQuant or rotations
    ("qwen3-qk-norm", "autoround", "W4A16", ()),  # learned rounding on both activation streams
    # Rotations: R1 folded into an untied model's embeddings and lm_head, and into a tied one's
    # once it is untied (its lm_head copied from the source's embeddings, range by range);
    # R4 on every expert's down projection; Gemma 3's R4 alone (its W8A8 default).
    ("llama-gqa-untied-llama3-rope", "gptq", "W8A8", ("R1", "R4")),
    ("qwen3-moe", "rtn", "W8A8", ("R1", "R4")),
    ("llama-tied", "autoround", "W4A16", ("R1", "R4")),
    ("gemma3-sliding-window", "rtn", "W8A8", None),
])
def test_streamed_artifact_is_the_whole_model_one_byte_for_byte(tmp_path, arch, method, scheme, rotations):
    _, src = build(tmp_path, arch)
    extra = {"group_size": 32} if scheme == "W4A16" else {}
    if method == "autoround":
        extra.update(iters=8, batch_size=4)
    if rotations != ():
        extra.update(hadamard_block_size=16)
    cfg = QuantConfig(scheme=scheme, method=method, calib_samples=8, calib_seq_len=48,
                      rotations=rotations, **extra)
    calib = token_ids(8, 48, 1)
    shard = 40_000  # several shards, so the grouping into files is compared too
    whole = quantize(src, cfg, None, str(tmp_path / "whole"), calib_token_ids=calib, max_shard_size=shard)
    streamed = quantize(src, cfg, None, str(tmp_path / "streamed"), calib_token_ids=calib, max_memory=8 * GIB,
                        max_shard_size=shard)
    files = model_files(whole.path)
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 2
    assert model_files(streamed.path) == files
    for art in (whole, streamed):  # readable by whoever serves them, as any file written with umask 022
        assert {oct(f.stat().st_mode & 0o777) for f in art.path.glob("*.safetensors")} == {"0o644"}
    # The embeddings and lm_head are larger than a shard here: each was written alone, range by
    # range, and safetensors reads those files as it reads its own.
    from safetensors.torch import load_file

    from quantpipe.formats.artifact import load_checkpoint

    index = json.loads(files["model.safetensors.index.json"])["weight_map"]
    assert len({index["model.embed_tokens.weight"]} | {f for n, f in index.items() if n != "model.embed_tokens.weight"}) \
        == len(set(index.values()))
    alone = load_file(streamed.path / index["model.embed_tokens.weight"])
    assert list(alone) == ["model.embed_tokens.weight"]
    _, state = load_checkpoint(streamed.path)
    assert set(state) == set(index)
    assert streamed.manifest["artifact_sha256"] == whole.manifest["artifact_sha256"]
    # The manifests too (GPTQ's dampening and AWQ's searches per layer included), but for what
    # records the run itself.
    run_only = ("time_s", "memory", "peak_rss_mib")
    assert {k: v for k, v in streamed.manifest.items() if k not in run_only} == \
        {k: v for k, v in whole.manifest.items() if k not in run_only}
    if method == "gptq":
        assert all(v["dampening"] is not None for v in streamed.manifest["layers"].values())
    if rotations != ():
        assert sorted(streamed.manifest["rotations"]) == sorted(rotations or ("R4",))
    if arch == "llama-tied" and "R1" in (rotations or ()):
        assert "lm_head.weight" in index and not json.loads(files["config.json"])["tie_word_embeddings"]
    assert whole.manifest["memory"] is None
    memory = streamed.manifest["memory"]
    assert memory["streamed"] and memory["peak_rss_mib"] <= 8 * 1024 and memory["plan"]["activations_on"] == "memory"


def test_streamed_default_model_from_its_gguf(tmp_path, w8a16_artifact):
    """The real default model, read tensor by tensor from its GGUF file (Q4_1 and Q8_0 blocks
    dequantized a row range at a time for the embeddings)."""
    # 8 GiB: the budget counts the whole process, here the test session with its fixtures.
    streamed = quantize(None, QuantConfig(scheme="W8A16"), None, str(tmp_path / "w8"), max_memory=8 * GIB)
    assert model_files(streamed.path) == model_files(w8a16_artifact)


def test_activations_on_disk_give_the_same_weights(tmp_path):
    """GPTQ's calibration activations written to disk between layers, not held in memory."""
    from quantpipe.quantize.rtn import WeightScheme
    from quantpipe.quantize.stage import _layerwise
    from quantpipe.runtime.model.config import fused_linears
    from quantpipe.runtime.model.loader import load_model

    _, src = build(tmp_path, "llama-tied")
    cfg = QuantConfig(scheme="W4A16", group_size=32, method="gptq")
    samples = token_ids(6, 48, 2)
    results = []
    for spill in (None, tmp_path / "spill"):
        net, mcfg, _ = load_model(src, torch.float32)
        schemes = {f"layers.{i}.{n}": WeightScheme(4, 32, True) for i in range(mcfg.num_layers)
                   for n, _ in fused_linears(mcfg, i)}
        if spill is not None:
            spill.mkdir()
        results.append(_layerwise(net, samples, schemes, cfg, torch.bfloat16, spill=spill)[0])
    assert results[0].keys() == results[1].keys()
    for name, qw in results[0].items():
        assert torch.equal(qw.q, results[1][name].q) and torch.equal(qw.scale, results[1][name].scale), name
    # Only the last layer's outputs are left (generation 0 is none, 1 the embeddings), one file a sequence.
    last = mcfg.num_layers + 1
    assert sorted(p.name for p in (tmp_path / "spill").iterdir()) == sorted(f"{last}-{k}.pt" for k in range(6))


def test_a_budget_too_small_or_an_option_it_lacks_is_refused_before_writing(tmp_path):
    _, src = build(tmp_path, "llama-tied")
    out = tmp_path / "out"
    with pytest.raises(StageError, match=r"--max-memory 1 MiB is too small for this model: .*the largest part is "
                                         r"the process before any layer"):
        quantize(src, QuantConfig(scheme="W8A16"), None, str(out), max_memory=1024 ** 2)
    with pytest.raises(StageError, match="does not take mixed precision"):
        quantize(src, QuantConfig(scheme="mixed", bits_budget=5.0), None, str(out), max_memory=GIB)
    with pytest.raises(StageError, match="does not take SmoothQuant"):
        quantize(src, QuantConfig(scheme="W8A8", smoothquant_alpha=0.5, rotations=()), None, str(out), max_memory=GIB)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["llama-tied"]
    assert parse_size("1.5GB", "--max-memory") == 1_500_000_000 and parse_size("512MiB", "x") == 512 * 1024 ** 2
    with pytest.raises(StageError, match=r"--max-memory '1.5 gallons': give a size such as 1.5GB"):
        parse_size("1.5 gallons", "--max-memory")


def test_a_corrupt_checkpoint_is_named_by_the_streamed_reader(tmp_path):
    import shutil

    _, src = build(tmp_path, "llama-tied")
    for damage, message in ((lambda b: b[:4], r"header length -1 in a 4-byte file"),
                            (lambda b: b[:8] + b"{not json" + b[17:], "its header is not JSON"),
                            (lambda b: b[:-100], r"data offsets .* do not match its shape")):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(src, bad)
        f = bad / "model.safetensors"
        f.write_bytes(damage(f.read_bytes()))
        with pytest.raises(StageError, match=rf"model: {f}: .*{message}"):
            quantize(str(bad), QuantConfig(scheme="W8A16"), None, str(tmp_path / "out"), max_memory=GIB)
        assert not (tmp_path / "out").exists()


def test_a_source_that_does_not_match_its_architecture_or_vocabulary_is_refused_before_reading(tmp_path):
    from safetensors.torch import load_file, save_file

    _, src = build(tmp_path, "llama-tied")
    state = load_file(Path(src) / "model.safetensors")
    state.pop("model.layers.1.post_attention_layernorm.weight")
    save_file(state, str(Path(src) / "model.safetensors"))
    with pytest.raises(StageError, match=r"model: weights do not match the architecture: missing "
                                         r"\['layers.1.post_attention_layernorm.weight'\]"):
        quantize(src, QuantConfig(scheme="W8A16"), None, str(tmp_path / "out"), max_memory=GIB)
    _, src = build(tmp_path / "b", "llama-tied")
    with pytest.raises(StageError, match="calibration token id 320 is outside the model's vocabulary of 320 tokens"):
        quantize(src, QuantConfig(scheme="W4A16", group_size=32, method="gptq"), None, str(tmp_path / "out"),
                 calib_token_ids=[list(range(200)), list(range(200, 321))], max_memory=8 * GIB)
    assert not (tmp_path / "out").exists()
