"""Expensive subprocess chains that run beside the rest of the suite, on idle CPU time.

Much of the suite leaves a core idle (servers waiting for requests, windows of traffic, an
MLflow server starting), while a few modules are pure computation that only spawns
`quantpipe` commands (the regression gate: calibrate, GPTQ, evals). Such a module sets
`IDLE_JOB = fn`, where fn(runner, folder) runs its commands through `runner.run` and
returns their results, or `IDLE_JOB = {"key": fn, ...}` for chains that do not depend on
each other (its result is then {"key": fn's result}). The session starts the selected
modules' chains at its first test, all at once, each command on one thread under the
SCHED_IDLE policy (`nice 19` where that policy is missing) in a session niced to 19: the
scheduler gives them only CPU time no other process wants, so the tests around them run as
they would alone. One thread per command: a chain then computes on whichever core is free,
where a two-thread command beside a busy core waits at every barrier for its thread on
that core (and the regression gate's run on one thread took 0.83x the CPU time of two,
with an identical GPTQ artifact). All at once: the scheduler shares the idle time among
the chains, so they end close together. Taken one per CPU in turn, the last chain started
when a worker came free and then ran alone on one core after the other tests had finished,
with the second core idle (about 115 s of the suite's end). The modules themselves run
last, and their fixtures wait for `IdleJobs.result(name)`.

What a job computes does not depend on when it runs: every command is deterministic (the
regression gate pins its CPU code paths), only the wall time moves. So no limit on a job is
a wall-clock one, which a slower machine or a busier suite would trip while the command only
waited for idle time (a regression-gate GPTQ of 120 s alone took 1,257 s at idle priority
beside the suite on a 2-core AVX2 machine): each command gets a budget of CPU time, enforced
by the kernel (RLIMIT_CPU) whatever the load, against a runaway computation; and the test
that waits for a job gives it a wall-clock wait counted from when it starts waiting, after
every other module has run and the job has the idle CPU to itself, against a command that
hangs without computing. A lock a job's command
shares with the other tests would let an idle-priority holder stall them, which is why the
runtime loads its built C++ kernels under a shared lock (runtime/model/cpu_attention.py).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable


def _idle_priority_within(cpu_seconds: int) -> Callable[[], None]:
    """The child's setup before exec: its CPU-time budget, then the lowest CPU priority."""

    def setup() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 10))  # SIGXCPU, then SIGKILL
        _idle_priority()

    return setup


def _idle_priority() -> None:
    """In the child, after it started its own session and before exec: lowest CPU priority,
    inherited by its threads and children. Where the kernel groups each session for fair
    sharing (autogroup), a thread's policy counts only inside its group, and a new session
    would get as much CPU as the tests' own group: the group is niced to 19 as well."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroup: the policy above is all the scheduler looks at
        pass


class Runner:
    """What a job gets: `run` starts a command at idle priority and waits for it."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._stopped = False

    def run(self, argv: list[str], cwd: Path, env: dict, cpu_seconds: int) -> subprocess.CompletedProcess:
        """Runs argv at idle priority, each process it starts allowed cpu_seconds of CPU time
        (user + system); a command the kernel stops at that budget raises."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the session ended before this job's command started")
            # One compute thread (see the module's text), which waits passively in OpenMP.
            one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
            proc = subprocess.Popen(argv, cwd=cwd, env={**env, **one_thread},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=_idle_priority_within(cpu_seconds), start_new_session=True)
            self._procs.append(proc)
        out, err = proc.communicate()
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not self._stopped:
            raise AssertionError(f"{argv[:4]} used up its {cpu_seconds} s of CPU time:\n{out[-2000:]}\n{err[-2000:]}")
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the command and everything it started
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for proc in self._procs:
                if proc.poll() is None:
                    self._kill(proc)


class IdleJobs:
    """The session's chains by module name, each run by a thread of its own from `start`."""

    def __init__(self) -> None:
        self._chains: list[tuple[Callable[[Runner, Path], object], Path, Future]] = []
        self._futures: dict[str, Future | dict[str, Future]] = {}
        self._runner = Runner()

    def add(self, name: str, job: Callable[[Runner, Path], object] | dict[str, Callable[[Runner, Path], object]],
            folder: Path) -> None:
        if callable(job):
            self._futures[name] = future = Future()
            self._chains.append((job, folder, future))
            return
        self._futures[name] = {}
        for key, chain in job.items():
            self._futures[name][key] = future = Future()
            (folder / key).mkdir()
            self._chains.append((chain, folder / key, future))

    def start(self) -> None:
        def work(job: Callable[[Runner, Path], object], folder: Path, future: Future) -> None:
            try:
                future.set_result(job(self._runner, folder))
            except BaseException as e:  # handed to the test that waits for it
                future.set_exception(e)

        for k, chain in enumerate(self._chains):  # every chain starts now, on a thread of its own
            threading.Thread(target=work, args=chain, name=f"idle-jobs-{k}", daemon=True).start()

    def result(self, name: str, wait: float = 1500):
        """The job's return value, once it has finished; its exception if it raised. For a
        dict of chains, {key: that chain's return value}. Waits at most `wait` seconds from
        this call (see the module's text)."""
        futures = self._futures[name]
        deadline = time.monotonic() + wait
        try:
            if isinstance(futures, Future):
                return futures.result(timeout=wait)
            return {key: future.result(timeout=max(0.0, deadline - time.monotonic()))
                    for key, future in futures.items()}
        except FutureTimeout:
            if all(f.done() for f in ([futures] if isinstance(futures, Future) else futures.values())):
                raise  # the job's own TimeoutError, not the wait's
            raise AssertionError(f"the idle job of {name} did not finish within {wait:g} s of its test's wait, "
                                 "with the rest of the suite done: a command hangs") from None

    def stop(self) -> None:
        self._runner.stop()
