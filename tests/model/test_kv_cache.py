"""KV cache in INT8 and FP8: the storage round trip, the engine on the default model
(no leaked blocks, prefix caching, greedy output independent of the batch but for near ties), its quality
against the model-dtype cache, and artifacts that declare a kv_cache_scheme."""

from __future__ import annotations

import json

import pytest
import torch

from quantpipe.manifest import StageError
from quantpipe.quantize import QuantConfig, quantize
from quantpipe.runtime import LLM, SamplingParams
from quantpipe.runtime.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, paged_attention
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.kv_cache import QuantizedKVCache, bytes_per_token, hadamard, make_kv_cache
from quantpipe.runtime.model.loader import load_model
from tests.model.test_parity_architectures import build
from tests.test_llm_default_model import BLOCK_FP32, mixed_prompts


def kv_like(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 3, 64] values with a few large channels, as rotated keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 64, generator=g)
    x[..., :4] *= 20
    return x


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_written_slots_read_back_within_the_format_step(kind):
    cache = QuantizedKVCache(8 * 4, 3, 64, torch.float32, "cpu", kind)
    k, v = kv_like(12), kv_like(12, seed=1)
    slots = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15, 28, 29, 30, 31])  # blocks 1, 3 and 7 of 4 slots
    seen_k, seen_v = cache.write(slots, k, v)
    got_k, got_v = cache.gather(torch.tensor([1, 3, 7]), 4)
    for x, got in ((k, got_k), (v, got_v)):
        err = (got - x).abs()
        if kind == "int8":  # half a step of amax / 127 per token and head (the scale rounded to fp16)
            step = x.abs().amax(-1) / 127
            assert (err <= step[..., None] * 0.51).all(), err.max()
        else:  # e4m3 keeps 3 mantissa bits: relative error <= 1/16, plus the subnormal floor
            scale = x.abs().amax(-1, keepdim=True) / 448
            assert (err <= x.abs() / 16 + scale * 2**-6).all(), err.max()
        assert err.max() > 0  # it is really stored in 8 bits
    # What write returns (a prefill's own keys) is exactly what a read of those slots gives.
    assert torch.equal(seen_k, got_k) and torch.equal(seen_v, got_v)


def test_attention_in_the_rotated_basis_is_attention():
    """paged_attention turns q, k, v into a cache's rotated basis and the output back: with
    lossless storage, the result is the unrotated one (prefill and decode, GQA)."""
    g = torch.Generator().manual_seed(5)
    plain, turned = (make_kv_cache(64, 3, 64, torch.float32, "cpu") for _ in range(2))
    turned.rotation = hadamard(64)
    assert torch.allclose(turned.rotation @ turned.rotation.mT, torch.eye(64), atol=1e-6)
    q, k, v = torch.randn(20, 9, 64, generator=g), kv_like(20, seed=2), kv_like(20, seed=3)
    prefill = AttentionMetadata(slot_mapping=torch.arange(16, 36), block_size=16,
                                prefills=[PrefillSpan(0, 20, 20, None)])
    outs = [paged_attention(q, k, v, c, prefill) for c in (plain, turned)]
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[0].abs().max()  # float32 rounding, values up to ~50
    decode = AttentionMetadata(slot_mapping=torch.tensor([36]), block_size=16, decodes=[
        DecodeGroup(0, 1, torch.tensor([[1, 2]]), (torch.arange(32) < 21)[None, None, None, :], torch.tensor([21]))])
    outs = [paged_attention(q[:1], k[:1], v[:1], c, decode) for c in (plain, turned)]
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[0].abs().max()


def test_the_rotation_lowers_the_int8_error_of_keys_with_large_channels():
    """Per-token INT8 of keys with a few large channels: the grid is set by those channels and
    the rest round coarsely; in the Hadamard basis every channel shares the range. Measured on
    the attention scores q.k, against the same grid stored unrotated."""
    g = torch.Generator().manual_seed(7)
    k, q = kv_like(256, seed=4), torch.randn(256, 3, 64, generator=g)
    errs = []
    for rotate in (False, True):
        cache = make_kv_cache(256, 3, 64, torch.float32, "cpu", "int8")
        assert cache.rotation is not None
        r = cache.rotation if rotate else torch.eye(64)
        seen, _ = cache.write(torch.arange(256), k @ r, k @ r)
        errs.append(((q * (seen @ r.mT)).sum(-1) - (q * k).sum(-1)).pow(2).mean().item())
    assert errs[1] < 0.5 * errs[0], errs


def test_tokens_per_byte_and_bad_names():
    bf16 = bytes_per_token(30, 3, 64, torch.bfloat16, "auto")
    # 64 one-byte values and an fp16 scale per token, KV head, K or V, and layer: 128 / 66 = 1.94x
    for kind in ("int8", "fp8"):
        assert bytes_per_token(30, 3, 64, torch.bfloat16, kind) == 2 * 30 * 3 * 66
    assert bytes_per_token(30, 3, 64, torch.bfloat16, "int8", static=True) == 2 * 30 * 3 * 64
    assert bf16 == 2 * 30 * 3 * 128
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8; got 'int4'"):
        make_kv_cache(16, 3, 64, torch.float32, "cpu", "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(dtype="float32", device="cpu", kv_cache_dtype="float8")


@pytest.fixture(scope="module")
def llm_int8():
    # 12 float32 blocks' worth of bytes hold 45 int8 blocks (720 tokens): two long requests wide.
    return LLM(dtype="float32", device="cpu", max_num_batched_tokens=256, kv_cache_memory=12 * BLOCK_FP32,
               kv_cache_dtype="int8")


@pytest.mark.slow
def test_int8_engine_frees_every_block_hits_the_prefix_cache_and_flips_only_near_ties(llm_int8, corpus_prompts):
    eng = llm_int8.engine
    assert eng.pool.num_blocks == 12 * BLOCK_FP32 // (16 * bytes_per_token(30, 3, 64, torch.float32, "int8"))
    tok = llm_int8.get_tokenizer()
    prompts = mixed_prompts(tok, corpus_prompts, n=24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = llm_int8.generate(prompts, params)
    assert eng.pool.num_free == eng.pool.num_blocks
    eng.pool.check_invariants()
    assert sum(r.metrics.num_cached_tokens for r in batched) > 0
    assert sum(r.metrics.num_preemptions for r in batched) > 0
    # Every token the batch chose is checked against the model run on that prompt and those
    # tokens alone (teacher-forced, the same INT8 round trip of the cache, one chunk, no
    # neighbours). In the batch each sequence was chunked, preempted or padded among others,
    # and float32 K/V differ in their last bits between those shapes; 8-bit rounding can
    # turn such a difference into one step of the grid, so a greedy choice may differ from
    # the lone run's argmax, but only where the model is nearly tied between the two tokens.
    # How many prompts meet such a tie depends on the CPU's float32 kernels (margins of
    # 0.02-0.09 seen on AVX2 and AVX-512 machines), so the margin of every choice is the
    # check, not a count of flips; a broken cache (a block mixed up, a stale prefix, a
    # preempted sequence resumed wrongly) picks tokens far below the argmax.
    shortfalls = []
    for p, b in zip(prompts, batched):
        got = b.outputs[0].token_ids
        logits = sequence_logits(eng.runner.model, p + got)[len(p) - 1: len(p) - 1 + len(got)]
        shortfalls += (logits.max(-1).values - logits.gather(1, torch.tensor(got).unsqueeze(1)).squeeze(1)).tolist()
    assert len(shortfalls) == 24 * 12
    assert max(shortfalls) < 0.1, sorted(shortfalls)[-5:]
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("kind, max_kl", [("int8", 0.002), ("fp8", 0.02)])
def test_kv_quantization_costs_little_on_the_default_model(corpus_prompts, kind, max_kl):
    model, _, tok = load_model(None, torch.float32)
    ids = tok.encode("\n\n".join(corpus_prompts))[:384]
    base = sequence_logits(model, ids).log_softmax(-1)
    model.kv_cache_dtype = kind
    got = sequence_logits(model, ids).log_softmax(-1)
    kl = (base.exp() * (base - got)).sum(-1).mean().item()
    assert 0 < kl < max_kl, kl
    assert (base.argmax(-1) == got.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_artifact_declares_its_kv_cache_and_the_runtime_serves_it(tmp_path, kind):
    from compressed_tensors.quantization import QuantizationConfig

    _, src = build(tmp_path, "llama-tied")
    out = str(tmp_path / "art")
    art = quantize(src, QuantConfig(scheme="W8A16", kv_cache=kind), None, out)
    qcfg = json.load(open(f"{out}/config.json"))["quantization_config"]
    parsed = QuantizationConfig.model_validate(qcfg).kv_cache_scheme
    assert (parsed.num_bits, parsed.type, parsed.strategy, parsed.dynamic) == \
        (8, "int" if kind == "int8" else "float", "token", True)
    assert art.manifest["kv_cache"].startswith(kind)
    model, _, _ = load_model(out, torch.float32)
    assert model.kv_cache_dtype == kind
    llm = LLM(model=out, dtype="float32", kv_cache_memory="4MiB")
    assert isinstance(llm.engine.runner.kv_caches[0], QuantizedKVCache) and llm.engine.runner.kv_caches[0].kind == kind
    out_ids = llm.generate([[3, 17, 250, 99]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out_ids[0].outputs[0].token_ids) == 6
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    # The engine's kv_cache_dtype overrides the artifact's, as vLLM's does.
    other = "fp8" if kind == "int8" else "int8"
    assert LLM(model=out, dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype=other).engine.kv_cache_dtype == other


def test_bad_kv_cache_choices_are_refused(tmp_path):
    with pytest.raises(StageError, match="kv_cache must be one of none, int8, fp8; got 'int4'"):
        QuantConfig(kv_cache="int4")
    _, src = build(tmp_path, "llama-tied")
    out = tmp_path / "art"
    quantize(src, QuantConfig(scheme="W8A16", kv_cache="int8"), None, str(out))
    cfg = json.load(open(out / "config.json"))
    cfg["quantization_config"]["kv_cache_scheme"]["num_bits"] = 4
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="kv_cache_scheme: 8-bit int or float only, got int 4"):
        load_model(str(out), torch.float32)


def test_static_scales_are_calibrated_stored_and_refused_when_bad(tmp_path):
    from safetensors.torch import load_file, save_file

    _, src = build(tmp_path, "llama-gqa-untied-llama3-rope")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 320, (48,), generator=g).tolist() for _ in range(8)]
    out = tmp_path / "art"
    art = quantize(src, QuantConfig(scheme="W8A16", kv_cache="int8", kv_cache_strategy="channel"), None, str(out),
                   calib_token_ids=ids)
    assert "static" in art.manifest["kv_cache"] and "kv_scales_s" in art.manifest["time_s"]
    state = load_file(out / "model.safetensors")
    k_scale = state["model.layers.1.self_attn.k_scale"]
    assert k_scale.shape == (2, 16) and (k_scale > 0).all()  # 2 KV heads x head_dim 16
    model, cfg, _ = load_model(str(out), torch.float32)
    assert torch.equal(model.layers[1].self_attn.kv_scales[0], k_scale)
    llm = LLM(model=str(out), dtype="bfloat16", kv_cache_memory="4MiB")
    plain = LLM(model=str(out), dtype="bfloat16", kv_cache_memory="4MiB", kv_cache_dtype="int8")
    assert llm.engine.runner.kv_caches[0].static is not None and plain.engine.runner.kv_caches[0].static is None
    assert llm.engine.pool.num_blocks * 16 * 2 * 2 * 2 * 16 <= 4 * 2**20  # 1 byte per value, no per-token scales
    r = llm.generate([ids[0][:10]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(r.outputs[0].token_ids) == 5 and llm.engine.pool.num_free == llm.engine.pool.num_blocks
    # A static scheme with its scales missing or not positive is refused, naming the tensor.
    state["model.layers.1.self_attn.k_scale"] = -k_scale
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_scale must hold 1, 2 or 32 positive"):
        load_model(str(out), torch.float32)
    del state["model.layers.1.self_attn.k_scale"]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_scale is missing"):
        load_model(str(out), torch.float32)
    with pytest.raises(StageError, match="static KV cache scales needs calibration data"):
        quantize(src, QuantConfig(scheme="W8A16", kv_cache="int8", kv_cache_strategy="channel"), None,
                 str(tmp_path / "b"))
    assert not (tmp_path / "b").exists()
