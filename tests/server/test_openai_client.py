"""The official openai client against the server; greedy outputs equal offline LLM.generate."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.conftest import corpus_prompts

MAX_TOKENS = 24
FLAGS = ("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--max-queued-requests", "16")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(*FLAGS)


@pytest.fixture(scope="module")
def offline():
    from quantpipe.runtime import LLM

    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompts():
    return corpus_prompts(16, 400)


def greedy():
    from quantpipe.runtime import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["SmolLM2-135M-Instruct"]


def test_completion_matches_offline(client, offline, prompts):
    want = offline.generate(prompts[:2], greedy())
    for prompt, ref in zip(prompts[:2], want):
        got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0)
        assert got.choices[0].text == ref.outputs[0].text
        assert got.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_completion_stream_matches_offline(client, offline, prompts):
    ref = offline.generate(prompts[2], greedy())[0]
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[2],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_offline(client, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    ref = offline.chat(messages, greedy())[0]
    got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.outputs[0].text
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)

    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                            max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids)


def test_stop_string_never_leaks_when_streaming(client, offline, prompts):
    """A stop string taken from the middle of the greedy output: streamed text ends right before it."""
    full = offline.generate(prompts[3], greedy())[0].outputs[0].text
    assert len(full) > 20
    stop = full[10:14]
    expect = full[: full.index(stop)]
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[3],
                                            max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=True))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[3], max_tokens=MAX_TOKENS,
                                    temperature=0, stop=stop)
    assert got.choices[0].text == expect


def test_logprobs_shapes(client):
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=4, temperature=0,
                                    logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) == 3 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == got.choices[0].text
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_echo_returns_the_prompt_and_its_logprobs(client, offline, prompts):
    """echo: the prompt's text, then the output; with logprobs, every prompt token's
    (None for the first), as offline prompt_logprobs computes them, and offsets into the text."""
    from quantpipe.runtime import SamplingParams

    ref = offline.generate(prompts[4], SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2))[0]
    n = len(ref.prompt_token_ids)
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[4], max_tokens=3, temperature=0,
                                    logprobs=2, echo=True)
    c = got.choices[0]
    assert c.text == prompts[4] + ref.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e.logprob for e in ref.prompt_logprobs[1:]] + [e.logprob for e in ref.outputs[0].logprobs]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-4
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens[:n]) == prompts[4] and lp.text_offset[n] == len(prompts[4])
    # Token ids in, the same scores out; streamed, the first chunk carries the prompt.
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[ref.prompt_token_ids], max_tokens=3,
                                       temperature=0, logprobs=2, echo=True).choices[0]
    assert by_ids.text == c.text and by_ids.logprobs.token_logprobs == lp.token_logprobs
    chunks = [ch for ch in client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[4], max_tokens=3,
                                                     temperature=0, logprobs=2, echo=True, stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2, temperature=0,
                                      echo=True).choices[0]
    assert plain.text.startswith("Hello") and plain.logprobs is None


def test_several_prompts_in_one_request(client, offline, prompts):
    """A list of prompts: one engine request each, one response whose choices follow the
    prompts' order (as vLLM and OpenAI answer it); one bad prompt refuses them all, named."""
    want = offline.generate(prompts[5:8], greedy())
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[5:8], max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]: prompt token ids must be < the vocabulary"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=[[1, 2], [3, 999999]], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stream: true takes one prompt per request"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=["a", "b"], max_tokens=2, stream=True)


def test_tokenizer_endpoints_as_lm_eval_reads_them(server):
    import httpx

    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] and info["model_max_length"] == 2048
    eos = httpx.post(server.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert len(eos.json()["tokens"]) == 1


@pytest.mark.slow
def test_sixteen_in_flight_match_offline(server, offline, prompts):
    """16 concurrent streaming + non-streaming requests, each equal to the offline batch."""
    want = [o.outputs[0].text for o in offline.generate(prompts, greedy())]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)

        async def one(i: int) -> str:
            if i % 2:
                r = await aclient.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[i],
                                                     max_tokens=MAX_TOKENS, temperature=0)
                return r.choices[0].text
            s = await aclient.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[i],
                                                 max_tokens=MAX_TOKENS, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in s])

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(16))), 240)
        finally:
            await aclient.close()

    got = asyncio.run(run())
    assert got == want
