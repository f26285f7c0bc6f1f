"""Disconnects and --request-timeout abort the request within a step and free its blocks."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.server.conftest import metric, wait_metric

LONG = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
USAGE = "quantpipe:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--request-timeout", "2",
                        "--drain-timeout", "0.5")


@pytest.fixture(scope="module")
def no_timeout_server(start_server):
    """For the disconnect tests: on a loaded machine a 2 s request timeout could free the
    blocks before the test looks, and the test would not be measuring a disconnect."""
    return start_server("--max-model-len", "2048", "--kv-cache-memory", "128MiB")


def test_stream_disconnect_frees_blocks(no_timeout_server):
    server = no_timeout_server
    before = metric(server.url, "quantpipe:request_aborted_total")
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            # Held in a name until the block ends: an iterator dropped after `break` is closed at
            # once, and closing httpx's line iterator closes the connection. The test then raced
            # the disconnect it means to make later (CI and a loaded machine saw usage 0.0 here,
            # with the request already counted as aborted).
            lines = r.iter_lines()
            chunks = []
            for line in lines:
                if line.startswith("data: "):
                    chunks.append(line)
                if len(chunks) >= 3:
                    break
            # Three token chunks, not an error event: the request is still running.
            assert all('"error"' not in c and c != "data: [DONE]" for c in chunks), (chunks, server.logs())
            # Still running, not aborted, and holding blocks mid-stream.
            seen = {name: metric(server.url, "quantpipe:" + name) for name in (
                "num_requests_running", "request_aborted_total")}
            assert seen == {"num_requests_running": 1, "request_aborted_total": before}, (seen, server.logs())
            assert metric(server.url, USAGE) > 0
    # Leaving the block closed the connection.
    assert wait_metric(server.url, USAGE, 0.0, timeout=1.0) == 0.0
    assert wait_metric(server.url, "quantpipe:request_aborted_total", before + 1, timeout=1.0) == before + 1
    assert metric(server.url, "quantpipe:num_requests_running") == 0


def test_non_stream_disconnect_frees_blocks(no_timeout_server):
    server = no_timeout_server
    before = metric(server.url, "quantpipe:request_aborted_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.8))
    assert wait_metric(server.url, USAGE, 0.0, timeout=1.0) == 0.0
    assert wait_metric(server.url, "quantpipe:request_aborted_total", before + 1, timeout=1.0) == before + 1


def test_timeout_non_stream(server):
    before = metric(server.url, "quantpipe:request_timeout_total")
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json=LONG, timeout=30)
    took = time.monotonic() - t0
    assert r.status_code == 408, r.text
    assert r.json()["error"]["code"] == "request_timeout"
    assert 1.9 < took < 5
    assert wait_metric(server.url, USAGE, 0.0, timeout=1.0) == 0.0
    assert metric(server.url, "quantpipe:request_timeout_total") == before + 1


def test_timeout_stream(server):
    before = metric(server.url, "quantpipe:request_timeout_total")
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 1500,
                            "ignore_eos": True, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"request_timeout"' in lines[-2]
    assert len(lines) > 3  # it streamed tokens before the deadline
    assert wait_metric(server.url, USAGE, 0.0, timeout=1.0) == 0.0
    assert metric(server.url, "quantpipe:request_timeout_total") == before + 1


def test_metrics_exposition(server):
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for name in ("quantpipe:num_requests_running", "quantpipe:num_requests_waiting", "quantpipe:kv_cache_usage_perc",
                 "quantpipe:kv_cache_blocks_used", "quantpipe:kv_cache_blocks_total", "quantpipe:kv_cache_bytes_used",
                 "quantpipe:prompt_tokens_total", "quantpipe:generation_tokens_total",
                 "quantpipe:prefix_cache_queries_total", "quantpipe:prefix_cache_hits_total",
                 "quantpipe:num_preemptions_total", "quantpipe:request_success_total",
                 "quantpipe:request_rejected_total", "quantpipe:request_aborted_total",
                 "quantpipe:request_timeout_total", "quantpipe:time_to_first_token_seconds_bucket",
                 "quantpipe:time_per_output_token_seconds_bucket", "quantpipe:e2e_request_latency_seconds_bucket",
                 "quantpipe:request_queue_time_seconds_bucket", "quantpipe:request_prefill_time_seconds_bucket",
                 "quantpipe:request_decode_time_seconds_bucket", "quantpipe:iteration_tokens_total_bucket",
                 "process_resident_memory_bytes"):
        assert f"\n{name}" in text, name
    assert 'model_name="SmolLM2-135M-Instruct"' in text
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200
    assert metric(server.url, "quantpipe:e2e_request_latency_seconds_count") >= 1
    assert metric(server.url, "quantpipe:generation_tokens_total") > 0


@pytest.mark.slow
def test_sigterm_past_drain_timeout_aborts_and_exits_zero(server):
    """Last in this module: it stops the server. A request longer than --drain-timeout is cut off."""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        lines = r.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data: ")).startswith("data: {")
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert "shut down" in rest[-2] and '"code":503' in rest[-2]
    assert server.proc.wait(15) == 0
    assert time.monotonic() - t0 < 8
