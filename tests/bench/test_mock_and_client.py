"""Load generator against the mock server: timing accuracy, exact token counts, failures."""

import asyncio
import threading

import numpy as np
import pytest

from quantpipe.cli import main
from quantpipe.runtime.bench.metrics import summarize
from quantpipe.runtime.bench.mock_server import spawn_mock
from quantpipe.runtime.bench.runner import BenchError, Runner, Target
from quantpipe.runtime.workload import HTTPTokenizer, WorkloadSpec, materialize


@pytest.fixture(scope="module")
def mock_url():
    with spawn_mock(ttft_ms=20, ttft_per_token_ms=0.05, itl_ms=5, concurrency=64) as url:
        yield url


def _run(url, reqs, concurrency=None, **target):
    async def go():
        r = Runner(Target(url, **target))
        try:
            await r.preflight()
            return await (r.closed_loop(reqs, concurrency) if concurrency else r.open_loop(reqs))
        finally:
            await r.aclose()
    return asyncio.run(go())


def _reqs(n=30, rate=15.0, prompt=200, out=16, tok=None):
    spec = WorkloadSpec.from_dict({"num_requests": n, "prompt_tokens": prompt, "output_tokens": out,
                                   "arrival": {"process": "poisson", "rate": rate}})
    return materialize(spec, tok)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_low_load_latency_matches_configuration(mock_url, endpoint):
    tok = HTTPTokenizer(mock_url)  # byte tokenizer of the mock: prompt lengths are exact
    reqs = _reqs(tok=tok)
    recs = _run(mock_url, reqs, endpoint=endpoint)
    assert all(r.ok for r in recs), [r.error for r in recs if not r.ok]
    assert all(r.output_tokens == 16 and r.output_tokens_source == "usage" for r in recs)
    assert all(len(r.chunk_times) == 16 for r in recs)
    assert all(r.prompt_tokens == 200 for r in recs)
    ttft = np.mean([r.ttft for r in recs])
    itl = np.mean([x for r in recs for x in r.itls])
    assert abs(ttft - (0.020 + 0.05e-3 * 200)) < 0.003
    assert abs(itl - 0.005) < 0.001
    s = summarize(recs)
    assert s["metrics"]["tpot"]["mean"]["value"] == pytest.approx(0.005, abs=0.001)


def test_non_streaming_and_token_ids(mock_url):
    recs = _run(mock_url, _reqs(n=5, out=4), stream=False, send_token_ids=True)
    assert all(r.ok and r.output_tokens == 4 for r in recs)
    assert all(r.prompt_tokens == r.planned_prompt_tokens for r in recs)  # ids counted one each


@pytest.mark.parametrize("endpoint, concurrency", [("completions", None), ("chat", None), ("chat", 4)])
def test_later_turns_carry_the_servers_real_replies(mock_url, endpoint, concurrency):
    """The mock counts one token per prompt byte and answers with WORDS in order, so each
    turn's usage.prompt_tokens tells exactly what conversation the client sent."""
    from quantpipe.runtime.bench.mock_server import WORDS

    spec = WorkloadSpec.from_dict({"num_requests": 9, "prompt_tokens": 30, "output_tokens": 5,
                                   "sessions": {"turns": 3, "think_time_s": 0.05},
                                   "arrival": {"process": "poisson", "rate": 20}})
    reqs = materialize(spec)
    recs = _run(mock_url, reqs, endpoint=endpoint, concurrency=concurrency)
    assert all(r.ok for r in recs) and len(recs) == 9
    reply = "".join(WORDS[:5])
    by_index = {r.spec.index: r for r in reqs}
    sent = {}  # request index -> bytes of the conversation it sent
    rec_of = {(r.session, r.turn): r for r in recs}  # closed loop records in send order
    for req in sorted(reqs, key=lambda r: r.spec.turn):
        rec = rec_of[req.spec.session, req.spec.turn]
        if req.spec.turn == 0:
            sent[req.spec.index] = len(req.prompt.encode())
        else:
            parent = by_index[req.spec.parent]
            sent[req.spec.index] = sent[parent.spec.index] + len(reply.encode()) + len(req.turn_text.encode())
            # the planned stand-in reply is corpus text, not the mock's words
            assert sent[req.spec.index] != len(req.prompt.encode())
        assert rec.prompt_tokens == sent[req.spec.index] and rec.prompt_tokens_source == "usage"
    assert sum(r.spec.turn > 0 for r in reqs) >= 3


def test_injected_errors_are_recorded():
    with spawn_mock(ttft_ms=1, itl_ms=1, error_rate=1.0, error_status=503) as url:
        recs = _run(url, _reqs(n=5, rate=50))
    assert all(r.status == 503 and "injected error" in r.error for r in recs)
    assert summarize(recs)["errors"] == {"503": 5}


def test_timeout_is_recorded_not_hung():
    with spawn_mock(ttft_ms=5000, itl_ms=1) as url:
        recs = _run(url, _reqs(n=3, rate=50), timeout_s=0.3)
    assert all(r.timed_out and not r.ok for r in recs)
    assert all(r.e2e < 1.0 for r in recs)


def test_unreachable_server_gives_clear_error(tmp_path, capsys):
    async def go():
        r = Runner(Target("http://127.0.0.1:9"))
        try:
            await r.preflight()
        finally:
            await r.aclose()
    with pytest.raises(BenchError, match="unreachable"):
        asyncio.run(go())
    rc = main(["bench", "run", "--url", "http://127.0.0.1:9", "--no-progress", "--output-dir", str(tmp_path)])
    assert rc == 2 and "unreachable" in capsys.readouterr().err


class _BadSSEServer:
    """Answers /v1/models, then streams one good chunk and one malformed (or no [DONE])."""

    def __init__(self, body: bytes):
        self.body = body
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()

    async def _handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
                await reader.readexactly(n)
                if head.startswith(b"GET"):
                    body = b'{"data":[{"id":"m"}]}'
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                                 + self.body)
                    await writer.drain()
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def __enter__(self):
        def run():
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            self.ready.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        self.ready.wait(5)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.mark.parametrize("body, err", [
    (b'data: {"choices":[{"text":"a"}]}\n\ndata: {not json\n\n', "malformed SSE"),
    (b'data: {"choices":[{"text":"a"}]}\n\n', "without data: [DONE]"),
])
def test_malformed_streams_fail_cleanly(body, err):
    with _BadSSEServer(body) as url:
        recs = _run(url, _reqs(n=2, rate=50), timeout_s=5)
    assert all(not r.ok and err in r.error for r in recs)
    assert all(r.first_token is not None for r in recs)  # partial data kept
