"""`quantpipe serve --request-log`: every request once, with what the client really got."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from quantpipe.runtime.server.request_log import RequestLog, RequestLogConfig
from tests.server.conftest import ROOT, metric

MODEL = "SmolLM2-135M-Instruct"
LABELS = {"task": "summarize", "conversation_id": "c-1", "tenant": "acme"}


def read_log(path: str) -> list[dict]:
    """Complete lines only, as a reader that skips a torn last line does."""
    with open(path, "rb") as f:
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines()]


def wait_lines(url: str, n: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while metric(url, "quantpipe:request_log_lines_total") < n:
        assert time.monotonic() < end, f"fewer than {n} lines logged after {timeout}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def logged(start_server, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reqlog") / "requests.jsonl")
    server = start_server("--dtype", "float32", "--kv-cache-memory", "128MiB", "--max-model-len", "1024",
                          "--max-queued-requests", "2", "--request-log", path)
    return server, path


def test_every_request_logged_once_with_what_the_client_got(logged):
    server, path = logged
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    expect: dict[str, tuple[str, str]] = {}  # id -> (status, text the client received)

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=12, temperature=0, metadata=LABELS)
    expect[chat.id] = ("ok", chat.choices[0].message.content)

    parts, sid = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count: 1, 2,"}],
                                                max_tokens=10, temperature=0, stream=True,
                                                metadata={"task": "count"}):
        sid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    expect[sid] = ("ok", "".join(parts))

    cmpl = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                     extra_body={"metadata": {"task": "complete"}}, user="u-7")
    expect[cmpl.id] = ("ok", cmpl.choices[0].text)

    # Several prompts in one request: a line per prompt, each holding its own prompt.
    two = client.completions.create(model=MODEL, prompt=["Grass is", "Snow is"], max_tokens=6, temperature=0)
    for i in range(2):
        expect[f"{two.id}-{i}"] = ("ok", two.choices[i].text)

    parts = []
    for chunk in client.completions.create(model=MODEL, prompt="Water is", max_tokens=8, temperature=0,
                                           stream=True):
        sid = chunk.id
        parts.append(chunk.choices[0].text if chunk.choices else "")
    expect[sid] = ("ok", "".join(parts))

    # A bad request: metadata over OpenAI's limit of 16 pairs is a 400 naming the field.
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       metadata={f"k{i}": "v" for i in range(17)})
    assert bad.value.body["param"] == "metadata" and "16" in bad.value.body["message"]
    expect[bad.value.response.headers["x-request-id"]] = ("error", "")

    # A client that disconnects mid-stream.
    received = ""
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as r:
            aborted_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    received += json.loads(line[6:])["choices"][0]["text"]
                    if len(received) > 10:
                        break

    # A burst past --max-queued-requests 2: some are refused with 429, the rest complete.
    results: list[httpx.Response] = []

    def post() -> None:
        results.append(httpx.post(server.url + "/v1/completions",
                                  json={"prompt": "Hi", "max_tokens": 16, "temperature": 0}, timeout=120))

    threads = [threading.Thread(target=post) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in results if r.status_code == 429]
    assert refused, [r.status_code for r in results]
    for r in results:
        assert r.status_code in (200, 429), r.text
        if r.status_code == 200:
            expect[r.json()["id"]] = ("ok", r.json()["choices"][0]["text"])
        else:
            expect[r.headers["x-request-id"]] = ("rejected", "")

    wait_lines(server.url, len(expect) + 1)
    records = read_log(path)
    ids = [rec["id"] for rec in records]
    assert len(ids) == len(set(ids)), "a request was logged twice"
    by_id = {rec["id"]: rec for rec in records}
    assert set(by_id) == set(expect) | {aborted_id}
    for rid, (status, text) in expect.items():
        rec = by_id[rid]
        assert rec["status"] == status, rec
        assert rec["output"]["text"] == text, rec
        assert rec["model"] == MODEL and isinstance(rec["created"], float)
        assert set(rec["timings"]) == {"queue_s", "ttft_s", "total_s"}
    assert by_id[chat.id]["metadata"] == LABELS
    assert by_id[chat.id]["endpoint"] == "/v1/chat/completions"
    assert by_id[chat.id]["request"]["messages"] == [{"role": "user", "content": "Name a color."}]
    assert by_id[chat.id]["output"]["finish_reason"] in ("stop", "length")
    assert by_id[chat.id]["usage"]["completion_tokens"] > 0 and by_id[chat.id]["timings"]["ttft_s"] > 0
    assert by_id[cmpl.id]["user"] == "u-7" and by_id[cmpl.id]["endpoint"] == "/v1/completions"
    assert by_id[cmpl.id]["metadata"] == {"task": "complete"}
    assert [by_id[f"{two.id}-{i}"]["request"]["prompt"] for i in range(2)] == ["Grass is", "Snow is"]
    # The aborted stream: what the server handed out starts with what the client read.
    rec = by_id[aborted_id]
    assert rec["status"] == "aborted" and rec["output"]["text"].startswith(received)
    assert rec["output"]["finish_reason"] is None
    assert all(by_id[r.headers["x-request-id"]]["error"]["status"] == 429 for r in refused)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert metric(server.url, "quantpipe:request_log_dropped_total") == 0


def test_kill_9_mid_load_leaves_only_complete_lines(start_server, tmp_path):
    path = str(tmp_path / "requests.jsonl")
    server = start_server("--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--request-log", path)
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                try:
                    c.post(server.url + "/v1/completions",
                           json={"prompt": "x " * 200, "max_tokens": 4, "metadata": {"task": "t" * 500}})
                except httpx.HTTPError:
                    return

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    wait_lines(server.url, 20, timeout=60)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    stop.set()
    for t in threads:
        t.join(30)
    records = read_log(path)  # every complete line parses
    assert len(records) >= 20 and all(r["status"] == "ok" for r in records)


def test_disk_full_keeps_serving_and_counts_drops(start_server):
    server = start_server("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--request-log", "/dev/full")
    for _ in range(3):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    end = time.monotonic() + 10
    while metric(server.url, "quantpipe:request_log_dropped_total") < 3 and time.monotonic() < end:
        time.sleep(0.05)
    assert metric(server.url, "quantpipe:request_log_dropped_total") == 3
    assert metric(server.url, "quantpipe:request_log_lines_total") == 0
    assert "dropping lines" in server.logs()  # one warning, not one per line
    assert server.logs().count("dropping lines") == 1


def test_log_in_missing_directory_refuses_to_start(tmp_path):
    missing = tmp_path / "nope" / "requests.jsonl"
    proc = subprocess.run([sys.executable, "-m", "quantpipe.runtime.server", "--request-log", str(missing)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "does not exist" in proc.stderr


# -- the writer on its own ---------------------------------------------------------------

def test_rotation_keeps_backups_and_whole_lines(tmp_path):
    path = str(tmp_path / "r.jsonl")
    rlog = RequestLog(RequestLogConfig(path, max_bytes=2000, backups=2))
    for i in range(100):
        rlog.write({"id": i, "pad": "x" * 80})
        while rlog.written <= i:  # one line per batch, so every rotation point is exercised
            time.sleep(0.0005)
    rlog.close()
    files = sorted(os.listdir(tmp_path))
    assert files == ["r.jsonl", "r.jsonl.1", "r.jsonl.2"]
    for name in files:
        assert os.path.getsize(tmp_path / name) <= 2000
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
        assert all(line.endswith("}") for line in (tmp_path / name).read_text().splitlines())
    ids = [r["id"] for name in ("r.jsonl.2", "r.jsonl.1", "r.jsonl") for r in read_log(str(tmp_path / name))]
    assert ids == sorted(ids) and ids[-1] == 99 and rlog.written == 100


def test_reopen_trims_a_torn_tail(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id": 2}\n{"id": 3, "te')
    rlog = RequestLog(RequestLogConfig(str(path)))
    rlog.write({"id": 4})
    rlog.close()
    assert [r["id"] for r in read_log(str(path))] == [1, 2, 4]
    assert path.read_bytes().endswith(b"}\n")


def test_bad_settings_name_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="request_log_max_bytes"):
        RequestLogConfig(str(tmp_path / "r.jsonl"), max_bytes=-1)
    with pytest.raises(ValueError, match="is a directory"):
        RequestLogConfig(str(tmp_path))
