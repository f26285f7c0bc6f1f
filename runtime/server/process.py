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


def _exit_with_parent(parent: int, cpus: frozenset[int] | None):
    """For the child, before exec: SIGTERM when the parent goes, however it goes, and the
    CPUs it may run on.

    A parent killed by a signal runs no `finally`, and a server left behind holds its model
    and KV cache (gigabytes) until someone finds it. Linux delivers the signal when the
    thread that started the child exits, so start servers from a thread that outlives them
    (every caller here uses the main thread)."""

    def preexec() -> None:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return preexec


def split_cpus(parts: int) -> list[frozenset[int] | None]:
    """The CPUs this process may use, cut into `parts` disjoint sets of (nearly) equal size.

    Servers that run at the same time on one host each start as many compute threads as
    there are cores; two busy ones then spin against each other (measured: two float32
    servers on 2 cores served 6.5x fewer requests than with a core each). One set per server
    keeps each side's latency its own. With fewer CPUs than parts, nothing is split (None).
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1; got {parts}")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < parts:
        return [None] * parts
    size, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(frozenset(cpus[start:end]))
        start = end
    return out


class Served:
    """`python -m quantpipe.runtime.server` on a free 127.0.0.1 port, stopped on exit.

    dtype "auto" is what production serves with (bf16 on CUDA and on CPUs with native
    bf16, float32 elsewhere), so a latency figure measures the kernels users would get.
    `cpus` pins the server to those CPUs with one compute thread each (see `split_cpus`).
    """

    def __init__(self, model: str | None, max_model_len: int = 2048, extra_args: list[str] | None = None,
                 ready_timeout_s: float = 180.0, dtype: str = "auto", cpus: frozenset[int] | None = None):
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
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        if cpus is not None:
            if sys.platform != "linux":
                raise ValueError("cpus: pinning a server to CPUs needs Linux")
            env["OMP_NUM_THREADS"] = str(len(cpus))  # torch's thread pool, one thread per CPU given
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_exit_with_parent(os.getpid(), cpus)
                                     if sys.platform == "linux" else None)

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
