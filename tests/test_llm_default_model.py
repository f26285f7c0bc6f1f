"""The default model (SmolLM2-135M-Instruct GGUF) against HF transformers, plus the LLM API."""

import math

import pytest
import torch

from quantpipe.runtime import LLM, SamplingParams
from tests.conftest import hf_greedy

BLOCK_FP32 = 2 * 30 * 16 * 3 * 64 * 4  # bytes of K and V for one 16-token block, all 30 layers


@pytest.fixture(scope="module")
def llm32():
    # 40 blocks of 16 = 640 tokens: two or three requests wide, so the batch below preempts.
    return LLM(dtype="float32", device="cpu", max_num_batched_tokens=256, kv_cache_memory=40 * BLOCK_FP32)


def mixed_prompts(tok, corpus, n=64):
    lengths = [3, 17, 40, 90, 160, 260]
    shared = tok.encode(corpus[0])[:45]  # ends mid-block
    prompts = []
    for i in range(n):
        ids = tok.encode(corpus[1 + i % (len(corpus) - 1)])[: lengths[i % len(lengths)]]
        prompts.append(shared + ids if i % 4 == 0 else ids)
    return prompts


@pytest.mark.slow
def test_greedy_batch_matches_hf(llm32, hf_default, corpus_prompts):
    tok = llm32.get_tokenizer()
    prompts = mixed_prompts(tok, corpus_prompts)
    outs = [6 + (i * 7) % 11 for i in range(len(prompts))]
    ref = hf_greedy(hf_default, prompts, outs)
    results = llm32.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs])
    got = [r.outputs[0].token_ids for r in results]
    mismatched = [i for i in range(len(got)) if got[i] != ref[i]]
    assert not mismatched, f"{len(mismatched)} differ; first {mismatched[0]}: {got[mismatched[0]]} vs {ref[mismatched[0]]}"
    assert sum(r.metrics.num_preemptions for r in results) > 0
    assert sum(r.metrics.num_cached_tokens for r in results) > 0
    assert llm32.engine.pool.num_free == llm32.engine.pool.num_blocks


def test_bf16_first_step_logits_match_reference(default_hf_dir, corpus_prompts):
    from transformers import AutoModelForCausalLM

    from quantpipe.runtime.engine.request import Request
    from quantpipe.runtime.engine.scheduler import ScheduledChunk

    llm = LLM(dtype="bfloat16", device="cpu", kv_cache_memory="64MiB")
    eng = llm.engine
    hf16 = AutoModelForCausalLM.from_pretrained(default_hf_dir, dtype=torch.bfloat16).eval()
    ids = eng.tokenizer.encode(corpus_prompts[3])[:120]
    req = Request("x", ids, 1, 0.0, block_ids=eng.pool.allocate(8))
    with torch.inference_mode():
        _, logits = eng.runner.execute([ScheduledChunk(req, 0, len(ids))])
        ref = hf16(torch.tensor([ids])).logits[0, -1].float()
    eng.pool.free_blocks(req.block_ids)
    diff = (logits[0] - ref).abs()
    # bf16 has 8 bits of mantissa: allow a few ulps at the logits' scale.
    assert diff.max() < 0.05 * ref.abs().max(), (diff.max(), ref.abs().max())
    assert logits[0].argmax() == ref.argmax()


def test_hf_folder_loads_the_same_model(default_hf_dir, llm32):
    from_folder = LLM(model=default_hf_dir, dtype="float32", device="cpu", kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=24)
    msgs = [{"role": "user", "content": "Name three rivers."}]
    assert from_folder.get_tokenizer().encode("Hello 123 wörld") == llm32.get_tokenizer().encode("Hello 123 wörld")
    assert from_folder.chat(msgs, params)[0].outputs[0].token_ids == llm32.chat(msgs, params)[0].outputs[0].token_ids


def test_chat_template_and_stop_on_end_of_turn(llm32):
    out = llm32.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=40))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in llm32.engine.model_config.eos_token_ids


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm32):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm32.generate("Once upon a time", p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3
    batch = llm32.generate(["Hello", "Once upon a time", "The sea"], [others[0], p, others[1]])
    assert batch[1].outputs[0].token_ids == alone
    unseeded = {tuple(llm32.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1


def test_stop_strings_tokens_min_tokens_and_logprobs(llm32):
    base = dict(temperature=0, max_tokens=30, ignore_eos=True)
    free = llm32.generate("The capital of France is", SamplingParams(**base))[0].outputs[0]
    word = free.text.split()[1]
    stopped = llm32.generate("The capital of France is", SamplingParams(stop=[word], **base))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert stopped.text == free.text[: free.text.index(word)]
    k = next(k for k in range(2, 30) if free.token_ids[k] not in free.token_ids[:k])
    tid = free.token_ids[k]
    by_id = llm32.generate("The capital of France is", SamplingParams(stop_token_ids=[tid], **base))[0].outputs[0]
    assert by_id.token_ids == free.token_ids[: k + 1] and by_id.stop_reason == tid
    late = llm32.generate("The capital of France is", SamplingParams(stop_token_ids=[tid], min_tokens=8, **base))[0].outputs[0]
    assert len(late.token_ids) >= 8 and tid not in late.token_ids[:8]
    lp = llm32.generate("The capital of France is", SamplingParams(logprobs=3, **{**base, "max_tokens": 4}))[0].outputs[0]
    assert len(lp.logprobs) == 4
    for token, entry in zip(lp.token_ids, lp.logprobs):
        assert len(entry.top_logprobs) == 3
        assert math.isclose(entry.logprob, max(entry.top_logprobs.values()), abs_tol=1e-5)  # greedy picks the top
        assert token in entry.top_logprobs


def test_prompt_logprobs_match_hf_through_cache_chunks_and_preemption(llm32, hf_default, corpus_prompts):
    """prompt_logprobs score every prompt token as HF transformers does, also for prompts
    whose prefix is already cached, that prefill in several chunks (256-token steps) or
    that are preempted and recomputed (640 tokens of KV for six requests)."""
    tok = llm32.get_tokenizer()
    shared = tok.encode(corpus_prompts[5])[:64]
    prompts = [shared + tok.encode(corpus_prompts[6 + i])[: 40 + 60 * i] for i in range(6)]
    llm32.generate([shared + [13]], SamplingParams(temperature=0, max_tokens=1))  # caches the shared blocks
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    results = llm32.generate(prompts, params)
    assert max(len(p) for p in prompts) > 256 and sum(r.metrics.num_preemptions for r in results) > 0
    assert all(r.metrics.num_cached_tokens == 0 for r in results)  # every position computed
    for ids, r in zip(prompts, results):
        with torch.inference_mode():
            ref = torch.log_softmax(hf_default(torch.tensor([ids])).logits[0].double(), -1)
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        plp = r.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        got = torch.tensor([e.logprob for e in plp[1:]], dtype=torch.float64)
        assert (got - want).abs().max() < 1e-3, (got - want).abs().max()
        for e, row in zip(plp[1:], ref[:-1]):
            assert len(e.top_logprobs) == 2 and int(row.argmax()) in e.top_logprobs
    # Once its prompt is scored a request reads the cache again; one that asks for no prompt logprobs has none.
    again = llm32.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert again.prompt_logprobs is None and again.metrics.num_cached_tokens > 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda llm: llm.generate("x" * 40000, SamplingParams()), "context holds"),
        (lambda llm: llm.generate("Hi", SamplingParams(max_tokens=9000)), "max_tokens=9000"),
        (lambda llm: llm.generate([[]], SamplingParams()), "prompt must not be empty"),
        (lambda llm: llm.generate([[1, 2, 999999]], SamplingParams()), r"\[0, 49152\)"),
        (lambda llm: llm.generate("Hi", SamplingParams(temperature=-1)), "temperature"),
        (lambda llm: llm.generate("Hi", SamplingParams(temperature=float("nan"))), "temperature"),
        (lambda llm: llm.generate("Hi", SamplingParams(top_p=0)), r"top_p must be in \(0, 1\]"),
        (lambda llm: llm.generate("Hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate("Hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate("Hi", SamplingParams(prompt_logprobs=21)), r"prompt_logprobs must be an integer in \[0, 20\]"),
        (lambda llm: llm.generate(["Hi", [5, 999999]], SamplingParams()), "prompt token ids"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(llm32, call, match):
    with pytest.raises(ValueError, match=match):
        call(llm32)
    eng = llm32.engine
    assert not eng.has_unfinished_requests() and eng.pool.num_free == eng.pool.num_blocks
    assert llm32.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_kv_budget_smaller_than_one_request():
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory=4 * BLOCK_FP32)  # 4 blocks = 64 tokens
    with pytest.raises(ValueError, match="KV cache holds 64 tokens.*kv_cache_memory"):
        llm.generate("Hello there", SamplingParams(max_tokens=100))
    assert llm.generate("Hello there", SamplingParams(max_tokens=10))[0].outputs[0].finish_reason in ("stop", "length")


def test_abort_frees_blocks(llm32):
    eng = llm32.engine
    rid = eng.add_request("Tell me a long story", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    out = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests() and eng.pool.num_free == eng.pool.num_blocks
