"""The idle jobs' limits (tests/idle_jobs.py) hold whatever the load: a command is stopped
by its CPU-time budget, not by the wall time it spent waiting for idle CPU, and a job that
never finishes fails its test's wait with the job named."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.idle_jobs import IdleJobs, Runner

ROOT = Path(__file__).resolve().parents[1]


def test_a_command_past_its_cpu_budget_is_stopped_and_named():
    runner = Runner()
    with pytest.raises(AssertionError, match=r"used up its 1 s of CPU time"):
        runner.run([sys.executable, "-c", "while True: pass"], cwd=ROOT, env={}, cpu_seconds=1)


def test_waiting_costs_a_command_no_budget():
    """A command that sleeps (as one starved of CPU waits) runs past its CPU budget in wall
    time and still finishes: the budget counts only the CPU it used."""
    runner = Runner()
    start = time.monotonic()
    done = runner.run([sys.executable, "-c", "import time; time.sleep(2.5); print('slept')"], cwd=ROOT, env={},
                      cpu_seconds=1)
    assert done.returncode == 0 and done.stdout.strip() == "slept"
    assert time.monotonic() - start >= 2.5


def test_a_job_that_never_finishes_fails_its_wait_by_name(tmp_path):
    jobs = IdleJobs()
    jobs.add("tests.hangs", lambda runner, folder: runner.run(
        [sys.executable, "-c", "import time; time.sleep(600)"], cwd=ROOT, env={}, cpu_seconds=60), tmp_path)
    jobs.start()
    try:
        with pytest.raises(AssertionError, match=r"idle job of tests\.hangs did not finish within 1 s"):
            jobs.result("tests.hangs", wait=1)
    finally:
        jobs.stop()  # kills the sleeping command
