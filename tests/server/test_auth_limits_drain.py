"""API keys, per-key rate limits, and graceful drain on SIGTERM (last: it stops the server)."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from tests.server.conftest import metric

RPS = 3


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text("# tenants\nk-rps\nk-tpm\n")
    return start_server("--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--api-key", "k-main",
                        "--api-key-file", str(keyfile), "--rate-limit-rps", str(RPS), "--rate-limit-tpm", "600",
                        "--drain-timeout", "20")


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": "k-main"}, {"Authorization": "Basic k-main"}])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models"])
def test_auth_required(server, headers, path):
    before = metric(server.url, "quantpipe:request_rejected_total", reason="auth")
    if path == "/v1/models":
        r = httpx.get(server.url + path, headers=headers, timeout=10)
    else:
        r = httpx.post(server.url + path, headers=headers, json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
    assert metric(server.url, "quantpipe:request_rejected_total", reason="auth") == before + 1


def test_health_and_metrics_open(server):
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=5).status_code == 200


def test_valid_key_with_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k-main", max_retries=0, timeout=60)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=3)
    assert r.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_rate_limit_rps_per_key(server):
    # Bodies that fail validation: the rate check comes first, and costs no compute.
    statuses, retry = [], []
    for _ in range(RPS + 3):
        r = httpx.post(server.url + "/v1/completions", headers=auth("k-rps"), json={}, timeout=10)
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry.append(int(r.headers["retry-after"]))
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert statuses[:RPS] == [400] * RPS and 429 in statuses[RPS:], statuses
    assert all(x >= 1 for x in retry)
    # Another key is untouched.
    ok = httpx.post(server.url + "/v1/completions", headers=auth("k-main"), json={"prompt": "a", "max_tokens": 1},
                    timeout=30)
    assert ok.status_code == 200


def test_rate_limit_tpm_per_key(server):
    body = {"prompt": [100] * 500, "max_tokens": 1}  # costs 501 of the 600 tokens/minute
    first = httpx.post(server.url + "/v1/completions", headers=auth("k-tpm"), json=body, timeout=60)
    assert first.status_code == 200, first.text
    second = httpx.post(server.url + "/v1/completions", headers=auth("k-tpm"), json=body, timeout=60)
    assert second.status_code == 429
    assert int(second.headers["retry-after"]) >= 1
    assert "tpm" in second.json()["error"]["message"]


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero(server):
    body = {"prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", headers=auth("k-main"), json=body) as r:
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert first.startswith("data: {")
            server.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + 5
            while httpx.get(server.url + "/health", timeout=5).status_code != 503:
                assert time.monotonic() < end, "never started draining"
                time.sleep(0.02)
            late = httpx.post(server.url + "/v1/completions", headers=auth("k-main"),
                              json={"prompt": "hi", "max_tokens": 1}, timeout=10)
            assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
            rest = [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2]  # the in-flight request ran to completion
    assert server.proc.wait(30) == 0
