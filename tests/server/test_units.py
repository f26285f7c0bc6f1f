"""Server pieces that need no model: stop-string hold-back, token buckets, admission accounting."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from quantpipe.runtime.sampling_params import SamplingParams
from quantpipe.runtime.server.async_engine import AsyncEngine, EngineRequest
from quantpipe.runtime.server.limits import RateLimiter, TokenBucket
from quantpipe.runtime.server.metrics import ServerMetrics
from quantpipe.runtime.server.stream import TextDeltas, held_back


def test_held_back():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["xyz"]) == 0
    assert held_back("ab", ["b", "abc"]) == 2
    assert held_back("", ["a"]) == 0


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(alphabet="abc \n", min_size=0, max_size=4), min_size=1, max_size=30),
       stops=st.lists(st.text(alphabet="abc \n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_streamed_text_is_always_a_prefix_of_the_final_text(pieces, stops):
    """Simulate the engine: text grows by pieces; the first complete stop string ends it, cut off."""
    deltas, text, sent = TextDeltas(stops), "", ""
    final = None
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            final = text[: min(hits)]
            sent += deltas.delta(final, finished=True)
            break
        sent += deltas.delta(text, finished=False)
        assert not any(s in sent for s in stops)
    if final is None:
        final = text
        sent += deltas.delta(text, finished=True)
    assert sent == final


def test_token_bucket_refills_and_allows_oversized_cost_when_full():
    b = TokenBucket(rate=10.0, capacity=60.0, tokens=60.0, stamp=0.0)
    assert b.wait_for(100, 0.0) == 0  # bigger than the bucket: passes when full, leaves debt
    b.take(100)
    assert b.wait_for(10, 0.0) == 5.0  # 50 in debt + 10 needed, at 10/s
    assert b.wait_for(10, 5.0) == 0


def test_rate_limiter_is_per_key():
    now = [0.0]
    rl = RateLimiter(rps=2, tpm=None, clock=lambda: now[0])
    assert [rl.check_request("a") for _ in range(3)][:2] == [0, 0]
    assert rl.check_request("a") > 0
    assert rl.check_request("b") == 0
    now[0] = 1.0
    assert rl.check_request("a") == 0


def _fake_engine():
    pool = SimpleNamespace(num_blocks=10, block_size=16, num_used=0, num_queries=0, num_hits=0)
    return SimpleNamespace(kv_cache_bytes=1000, pool=pool)


def test_admission_accounting():
    ae = AsyncEngine(_fake_engine(), ServerMetrics("m"))
    assert ae.try_admit(50, 2, 100) is None
    ae._loop = None
    ae.add(EngineRequest("r1", [1, 2], SamplingParams(max_tokens=48), 0.0, cost_tokens=50))
    assert ae.queue_load() == (1, 50)
    assert "max-queued-tokens" in ae.try_admit(51, 2, 100)
    assert ae.try_admit(50, 2, 100) is None
    ae.add(EngineRequest("r2", [1], SamplingParams(max_tokens=9), 0.0, cost_tokens=10))
    assert "max-queued-requests" in ae.try_admit(1, 2, 100)
    assert ae.abort("r1") and not ae.abort("r1")  # idempotent
    assert ae.queue_load() == (1, 10)


def _gate_client(**config):
    import asyncio

    import httpx

    from quantpipe.runtime.server.config import ServerConfig
    from quantpipe.runtime.server.gate import Gate, ServerState

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    state = ServerState()
    ae = AsyncEngine(_fake_engine(), ServerMetrics("m"))
    cfg = ServerConfig(**config)
    gate = Gate(inner, config=cfg, state=state, aengine=ae, limiter=RateLimiter(None, None), metrics=ae.metrics)

    def get(method: str, path: str, key: str | None = None) -> int:
        async def go():
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as c:
                return (await c.request(method, path, headers=headers)).status_code
        return asyncio.run(go())

    return get, state


def test_gate_protect_metrics_and_draining():
    get, state = _gate_client(api_keys=["k"], protect_metrics=True)
    assert get("GET", "/metrics") == 401 and get("GET", "/health") == 401
    assert get("GET", "/metrics", "k") == 200 and get("POST", "/tokenize", "k") == 200
    state.draining = True
    assert get("POST", "/v1/completions", "k") == 503
    assert get("POST", "/v1/completions") == 401  # auth still comes first

    open_get, _ = _gate_client(api_keys=["k"])
    assert open_get("GET", "/metrics") == 200 and open_get("GET", "/health") == 200
    assert open_get("GET", "/v1/models") == 401


def test_gate_queue_limit():
    get, _ = _gate_client(max_queued_requests=0)
    assert get("POST", "/v1/completions") == 429
    assert get("POST", "/tokenize") == 200  # only generation is queued


def test_the_runtime_entry_point_leaves_registry_uris_to_quantpipe_serve(capsys):
    from quantpipe.runtime.server.cli import main

    assert main(["models:/smol@champion"]) == 2
    err = capsys.readouterr().err
    assert "registry URIs are resolved by `quantpipe serve`" in err and "Traceback" not in err
