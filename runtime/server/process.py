"""A runtime server in a subprocess on a free 127.0.0.1 port: what the latency A/B and
the canary serve each model with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


class ServerStartError(RuntimeError):
    pass


def _exit_with_parent(parent: int):
    """For the child, before exec: SIGTERM when the parent goes, however it goes.

    A parent killed by a signal runs no `finally`, and a server left behind holds its model
    and KV cache (gigabytes) until someone finds it. Linux delivers the signal when the
    thread that started the child exits, so start servers from a thread that outlives them
    (every caller here uses the main thread)."""

    def preexec() -> None:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return preexec


class Served:
    """`python -m quantpipe.runtime.server` on a free 127.0.0.1 port, stopped on exit.

    dtype "auto" is what production serves with (bf16 on CUDA and on CPUs with native
    bf16, float32 elsewhere), so a latency figure measures the kernels users would get.
    """

    def __init__(self, model: str | None, max_model_len: int = 2048, extra_args: list[str] | None = None,
                 ready_timeout_s: float = 180.0, dtype: str = "auto"):
        self.ready_timeout_s = ready_timeout_s
        self.name = model or "the default model"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "quantpipe.runtime.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--log-level", "warning"]
        if model:
            cmd += ["--model", model]
        cmd += extra_args or []
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
                                     preexec_fn=_exit_with_parent(os.getpid()) if sys.platform == "linux" else None)

    def __enter__(self) -> Served:
        end = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise ServerStartError(f"the server for {self.name} exited with {self.proc.returncode}:\n"
                                       f"{self.log.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise ServerStartError(f"the server for {self.name} was not ready within {self.ready_timeout_s:g} s")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
