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


@pytest.mark.parametrize("available, parts, sizes", [
    (range(2), 2, [1, 1]), (range(5), 2, [3, 2]), (range(8), 3, [3, 3, 2]), (range(1), 2, None), (range(4), 1, [4]),
])
def test_split_cpus_gives_disjoint_sets_covering_every_cpu(monkeypatch, available, parts, sizes):
    from quantpipe.runtime.server import process

    monkeypatch.setattr(process.os, "sched_getaffinity", lambda pid: set(available), raising=False)
    got = process.split_cpus(parts)
    assert len(got) == parts
    if sizes is None:  # fewer CPUs than servers: nothing to split, every server shares them
        assert got == [None] * parts
        return
    assert [len(s) for s in got] == sizes
    assert set().union(*got) == set(available)
    assert sum(len(s) for s in got) == len(set(available))  # disjoint


def test_split_cpus_refuses_zero_parts():
    from quantpipe.runtime.server.process import split_cpus

    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_cpus(0)
