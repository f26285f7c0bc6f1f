"""Ray, where a job outgrows one machine: `--ray ADDRESS` (or RAY_ADDRESS) on calibrate,
eval and the pipeline. Optional: `pip install 'quantpipe[ray]'`; without an address
nothing here is imported and every stage runs in this process as before.

Every task declares what it needs (`TaskResources`: CPUs, memory, GPUs), so Ray places a
model-sized task only where the memory is and a latency A/B only on a GPU node when it
asks for one. Every node must run the same quantpipe: each task reports its
`code_version()` and a result from another version is refused, never merged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from quantpipe.manifest import StageError, code_version

ENV = "RAY_ADDRESS"
INSTALL_HINT = "pip install 'quantpipe[ray]'"


def address(option: str | None) -> str | None:
    """The cluster to use: the option, else RAY_ADDRESS, else None (run here)."""
    return option or os.environ.get(ENV) or None


@dataclass(frozen=True)
class TaskResources:
    """What one task asks the scheduler for (Ray's num_cpus, memory and num_gpus)."""

    num_cpus: float = 1.0
    memory: int = 0  # bytes; 0 declares none
    num_gpus: float = 0.0

    def __post_init__(self) -> None:
        if not self.num_cpus > 0:
            raise StageError(f"ray task CPUs must be > 0, got {self.num_cpus!r}")
        if self.memory < 0 or self.num_gpus < 0:
            raise StageError(f"ray task memory and GPUs must be >= 0, got {self.memory!r} and {self.num_gpus!r}")

    def options(self) -> dict:
        out = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            out["memory"] = int(self.memory)
        return out

    def to_dict(self) -> dict:
        return {"num_cpus": self.num_cpus, "memory": int(self.memory), "num_gpus": self.num_gpus}


def cli_options(what: str):
    """`--ray`, `--ray-cpus` and `--ray-gpus` for a command whose Ray work `what` describes."""
    import click

    def add(command):
        command = click.option("--ray-gpus", type=float, default=0.0, show_default=True,
                               help="GPUs the latency A/B's task declares (it then runs on a GPU node)")(command)
        command = click.option("--ray-cpus", type=float, default=1.0, show_default=True,
                               help="CPUs each Ray task declares")(command)
        return click.option("--ray", default=None, envvar=ENV, show_envvar=True,
                            help=f"a Ray cluster's address: {what} ({INSTALL_HINT})")(command)

    return add


def import_ray(option: str, where: str):
    try:
        import ray
    except ImportError:
        raise StageError(f"{option} {where}: Ray is not installed ({INSTALL_HINT})") from None
    return ray


@contextlib.contextmanager
def session(where: str, option: str = "--ray") -> Iterator:
    """Connected to the cluster at `where` for the block (ray.init / ray.shutdown), unless this
    process is connected already, in which case that connection is used and kept."""
    ray = import_ray(option, where)
    if ray.is_initialized():
        yield ray
        return
    _reachable(where, option)
    try:
        # The driver's own log lines stay ours: workers' output is not echoed here.
        ray.init(address=where, log_to_driver=False, logging_level="ERROR", include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise StageError(f"{option} {where}: cannot connect to a Ray cluster ({str(e).splitlines()[0]})") from None
    try:
        yield ray
    finally:
        ray.shutdown()


CONNECT_TIMEOUT_S = 10
# What a task needs beyond the models it loads: a worker with torch imported, one text's
# logits, a tokenizer.
TASK_OVERHEAD_BYTES = 1 << 30


def float32_model_bytes(model: str | None) -> int:
    """A model's weights in float32, from its tensors' shapes (no tensor is read): what a task
    that loads it declares, per copy."""
    import math

    from quantpipe.runtime.model.loader import open_lazy

    lazy = open_lazy(model)
    return 4 * sum(math.prod(lazy.shape(n)) for n in lazy.names())


def _reachable(where: str, option: str) -> None:
    """Refuse an address nothing answers at, in seconds: ray.init itself retries for minutes."""
    import socket

    hostport = where.split("://", 1)[-1].rstrip("/")
    if where == "auto" or ":" not in hostport:
        return  # Ray finds (or fails to find) the local cluster itself
    host, _, port = hostport.rpartition(":")
    if not port.isdigit():
        raise StageError(f"{option} {where}: expected host:port (or ray://host:port, or auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise StageError(f"{option} {where}: no Ray cluster answers there within {CONNECT_TIMEOUT_S} s "
                         f"({e.strerror or e})") from None


def cluster_cpus(ray) -> int:
    """The CPUs the cluster has in all (at least 1)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def versioned(fn, cwd: str | None = None):
    """`fn` wrapped to return (code_version(), result), what `check_version` reads on the
    driver, and to run in `cwd`: the driver's working directory, so that the relative paths
    a stage was given name the same files on every node (they share its storage)."""
    def run(*args, **kwargs):
        here = os.getcwd()
        if cwd:
            os.chdir(cwd)
        try:
            return code_version(), fn(*args, **kwargs)
        finally:
            os.chdir(here)

    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def check_version(reply, option: str = "--ray"):
    """A versioned task's result, refused when the node that ran it has another quantpipe."""
    theirs, result = reply
    ours = code_version()
    if theirs != ours:
        raise StageError(f"{option}: a Ray worker runs quantpipe {theirs}, this process {ours}; install the same "
                         f"version on every node")
    return result


def run_tasks(ray, fn, calls: list[tuple], resources: TaskResources, option: str = "--ray") -> list:
    """`fn(*args)` for each args in `calls` as Ray tasks declaring `resources`; the results in
    call order. Tasks are not retried: one that failed on good input fails again, and a
    stage's error names its input. A task's StageError reaches the caller as itself; a task
    that dies (out of memory, a lost node) is a StageError naming the task. On any failure
    the tasks still running are cancelled."""
    remote = ray.remote(versioned(fn, os.getcwd())).options(**resources.options(), max_retries=0)
    refs = [remote.remote(*args) for args in calls]
    try:
        return [check_version(ray.get(ref), option) for ref in refs]
    except ray.exceptions.RayTaskError as e:
        _cancel(ray, refs)
        if isinstance(e.cause, StageError):
            raise StageError(*e.cause.args) from None
        raise StageError(f"{option}: Ray task {fn.__name__} failed: {_first_line(e.cause or e)}") from None
    except ray.exceptions.RayError as e:
        _cancel(ray, refs)
        raise StageError(f"{option}: Ray task {fn.__name__} did not finish: {_first_line(e)}") from None
    except BaseException:
        _cancel(ray, refs)
        raise


def _cancel(ray, refs) -> None:
    """Nothing left running on the cluster after a failure: the tasks that have not finished
    are cancelled. A finished one (the task whose failure is being raised) is never
    cancelled: in Ray 2.60 cancelling a task whose reply the driver is still processing
    aborts the driver on an internal check ("Tried to complete task that was not pending",
    the race of ray-project/ray#54798)."""
    with contextlib.suppress(Exception):
        _, running = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        for ref in running:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
