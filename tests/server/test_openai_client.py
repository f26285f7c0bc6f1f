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
