"""Greedy outputs equal HF transformers' on small random models of every supported
architecture, through chunked prefill, prefix-cache hits and preemptions."""

import random

import pytest
import torch

from quantpipe.runtime import LLM, SamplingParams
from tests.conftest import hf_greedy

ARCHS = {
    "llama-gqa-untied-llama3-rope": ("LlamaConfig", dict(
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-qk-norm": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32)),
    # A 16-token window, so most prompts and decodes reach past it; a score scale other than head_dim's.
    "gemma3-sliding-window": ("Gemma3TextConfig", dict(
        tie_word_embeddings=True, head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=12, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 50000.0},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
    )),
}
# YaRN rope scaling (Qwen's long-context setting), over an original context of 64.
ARCHS_ROPE = {
    "qwen3-yarn": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
}
# Mixtures of experts: 8 (4) experts, 2 per token; Qwen3-MoE with a dense layer after its sparse one.
MOE_ARCHS = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
    # A shared expert beside the routed ones, q/k/v bias, routing weights not renormalized.
    "qwen2-moe": ("Qwen2MoeConfig", dict(tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         norm_topk_prob=False, mlp_only_layers=[0], qkv_bias=True)),
}


def build(tmp_path, arch: str):
    import transformers

    cls_name, extra = {**ARCHS, **ARCHS_ROPE, **MOE_ARCHS}[arch]
    cfg = getattr(transformers, cls_name)(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if arch in ("qwen2-bias", "qwen2-moe"):  # make the bias matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if arch in MOE_ARCHS:  # a router that starts at zero ties every expert: give it preferences
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                torch.nn.init.normal_(p, std=0.5)
    if arch.startswith("gemma3"):  # Gemma's norms start at zero (scale 1 + weight): make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.normal_(p, std=0.3)
    path = tmp_path / arch
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model, str(path)


def workload(seed=0, n=64):
    """Mixed lengths; a third share a 37-token prefix (ends mid-block); outputs 4-20 tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(320) for _ in range(37)]
    prompts, outs = [], []
    for i in range(n):
        body = [rng.randrange(320) for _ in range(rng.choice([1, 3, 15, 16, 17, 40, 90, 150]))]
        prompts.append(prefix + body if i % 3 == 0 else body)
        outs.append(rng.randint(4, 20))
    return prompts, outs


@pytest.mark.parametrize("arch", list(ARCHS) + list(ARCHS_ROPE) + list(MOE_ARCHS))
def test_greedy_matches_hf(tmp_path, arch):
    hf, path = build(tmp_path, arch)
    prompts, outs = workload()
    ref = hf_greedy(hf, prompts, outs)
    # ~10 blocks hold one long request: a budget of 40 blocks forces preemptions.
    per_block = 2 * 2 * 16 * 2 * (getattr(hf.config, "head_dim", None) or 16) * 4
    llm = LLM(model=path, dtype="float32", device="cpu", max_num_batched_tokens=64, kv_cache_memory=40 * per_block)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    results = llm.generate(prompts, params)
    got = [r.outputs[0].token_ids for r in results]
    mismatched = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    assert not mismatched, f"{len(mismatched)} of 64 differ, first: {mismatched[0]}: {got[mismatched[0]]} vs {ref[mismatched[0]]}"
    assert sum(r.metrics.num_preemptions for r in results) > 0, "the KV budget should force preemptions"
    assert sum(r.metrics.num_cached_tokens for r in results) > 0, "shared prefixes should hit the cache"
    pool = llm.engine.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("arch", list(ARCHS) + list(ARCHS_ROPE) + list(MOE_ARCHS))
def test_logits_match_hf(tmp_path, arch):
    """Teacher-forced float32 logits over 200 positions (past the YaRN model's original 64 and
    the Gemma model's window of 16): greedy tokens of random models can hide a difference."""
    from quantpipe.runtime.model.forward import sequence_logits
    from quantpipe.runtime.model.loader import load_model

    hf, path = build(tmp_path, arch)
    ids = [random.Random(i).randrange(320) for i in range(200)]
    model, _, _ = load_model(path, torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
        got = sequence_logits(model, ids)
    assert (got - ref).abs().max() < 1e-4 * max(1.0, float(ref.abs().max())), (got - ref).abs().max()


def test_unsupported_architecture_and_fields_are_refused(tmp_path):

    from quantpipe.runtime.model.config import ModelConfig

    with pytest.raises(ValueError, match="architecture.*GPT2LMHeadModel"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
    base = dict(architectures=["MistralForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf({**base, "sliding_window": 4096})
    with pytest.raises(ValueError, match="rope_scaling of type 'longrope' is not supported .only 'llama3', 'yarn'"):
        ModelConfig.from_hf({**base, "sliding_window": None, "rope_scaling": {"rope_type": "longrope", "factor": 2}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf({**base, "sliding_window": None, "hidden_act": "gelu"})
    moe = dict(base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=16 is not supported: Qwen3-MoE has no"):
        ModelConfig.from_hf({**moe, "architectures": ["Qwen3MoeForCausalLM"], "shared_expert_intermediate_size": 16})
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=-1 must be a non-negative integer"):
        ModelConfig.from_hf({**moe, "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": -1})
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf({**moe, "architectures": ["Qwen2MoeForCausalLM"], "use_sliding_window": True})
    q2 = ModelConfig.from_hf({**moe, "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 16})
    assert q2.attention_bias and q2.shared_expert_intermediate_size == 16  # Qwen2-MoE's q/k/v bias is on by default


def test_gemma3_logprobs_match_hf_past_the_window(tmp_path):
    """Greedy tokens of a small random model barely depend on a 16-token window, so this
    compares log-probabilities: of prompt tokens (prefilled in 32-token chunks, each reading
    the earlier ones from the cache), of generated tokens (decodes inside the window and past
    it), and again with the prompts' blocks already cached."""
    hf, path = build(tmp_path, "gemma3-sliding-window")
    rng = random.Random(1)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (10, 40, 90, 150)]
    llm = LLM(model=path, dtype="float32", device="cpu", max_num_batched_tokens=32)
    scored = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1,
                                                  prompt_logprobs=1))
    cached = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1))
    assert all(r.metrics.num_cached_tokens > 0 for r in cached[1:])
    for ids, r in [*zip(prompts, scored), *zip(prompts, cached)]:
        out = r.outputs[0]
        full = ids + out.token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), -1)
        want = ref[torch.arange(len(full) - 1), torch.tensor(full[1:])]
        got = [e.logprob for e in out.logprobs]
        if r.prompt_logprobs is not None:
            got = [e.logprob for e in r.prompt_logprobs[1:]] + got
        else:
            want = want[len(ids) - 1:]
        diff = (torch.tensor(got, dtype=torch.float64) - want).abs().max()
        assert diff < 1e-4, (len(ids), diff)


def test_gemma3_config_fields_are_checked():
    from quantpipe.runtime.model.config import ModelConfig

    base = dict(architectures=["Gemma3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=2, sliding_window=4)
    cfg = ModelConfig.from_hf({**base, "_sliding_window_pattern": 2, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.rope_local_theta == 1e4
    for bad, match in [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping.*soft-capping"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"layer_types": ["sliding_attention"]}, "layer_types must list 2"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must list 2"),
        ({"sliding_window": None}, "sliding_window=None must be a positive integer"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "of type 'yarn'.*'linear'"),
    ]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf({**base, **bad})


def test_sharded_hf_folder_loads_through_its_index(tmp_path):
    hf, path = build(tmp_path, "llama-gqa-untied-llama3-rope")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    prompts, outs = workload(n=8)
    llm = LLM(model=str(tmp_path / "sharded"), dtype="float32", device="cpu")
    got = [r.outputs[0].token_ids for r in llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs])]
    assert got == hf_greedy(hf, prompts, outs)
