"""Served: the runtime server a stage starts goes away with the stage, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTS_A_SERVER = """
import sys, time
from quantpipe.runtime.server.process import Served
with Served(None, 512, ["--kv-cache-memory", "64MiB"]) as s:
    print(s.proc.pid, flush=True)
    time.sleep(600)
"""


def proc_stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_server_exits_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", STARTS_A_SERVER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        server = int(parent.stdout.readline())
        assert alive(server)
        parent.send_signal(signal.SIGKILL)  # no finally, no context manager runs
        parent.wait(10)
        end = time.monotonic() + 30
        while alive(server) and time.monotonic() < end:
            time.sleep(0.2)
        assert not alive(server), "the server outlived the process that started it"
    finally:
        parent.kill()
        if "server" in locals() and alive(server):
            os.kill(server, signal.SIGKILL)
