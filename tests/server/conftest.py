"""A real `python -m quantpipe.runtime.server` subprocess per test module, on a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "quantpipe.runtime.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *args]
        env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # second signal path: immediate exit after drain start
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """Factory: start_server(*flags) -> ready ServerProcess, killed at module teardown."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        log = str(tmp_path_factory.mktemp("server") / "server.log")
        server = ServerProcess(*args, log_path=log)
        started.append(server)
        return server.wait_ready()

    yield start
    for s in started:
        s.stop()


def metric(url: str, name: str, headers: dict | None = None, **labels) -> float:
    """One sample's value from /metrics (sum over label sets matching `labels`)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=5).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        base, _, rest = series.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"{name} {labels} not in /metrics")
    return total


def wait_metric(url: str, name: str, want: float, timeout: float = 1.0, **labels) -> float:
    end = time.monotonic() + timeout
    while True:
        v = metric(url, name, **labels)
        if v == want or time.monotonic() > end:
            return v
        time.sleep(0.02)


def corpus_prompts(n: int, chars: int) -> list[str]:
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics) if len(topics[k]) > chars + 100]
    return [texts[i % len(texts)][:chars] for i in range(n)]
