"""The CPU paged decode kernel (csrc/paged_decode.cpp), compiled once per machine on first use,
in one module with the fused bf16 element-wise ops (csrc/elementwise.cpp, fused_elementwise.py)
and the W8A16 decode kernel (csrc/int8_linear.cpp, quantized.Int8PackLinear).

It reads K/V straight from their blocks (caches in the model dtype, and dynamic INT8 ones
with each token's scales applied once per token), where the torch path gathers them into
a padded, dequantized copy and lays them out for two GEMMs (benchmarks/bench_decode_attention.py, BENCHMARKS.md).
Compiling needs a C++ compiler (torch.utils.cpp_extension, about 40 s, cached per source,
torch and Python version and CPU); without one the torch path is used and that is said once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger("quantpipe.runtime")

# One module: the decode kernel, the fused element-wise ops and the int8 Linear (one build, one cache key).
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode.cpp", "elementwise.cpp", "int8_linear.cpp",
                                                           "packed_linear.cpp")]


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_directory(name: str) -> Path:
    """Where the module `name` is built and cached: under TORCH_EXTENSIONS_DIR, else torch's
    extension cache."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


@contextlib.contextmanager
def _locked(path: Path, exclusive: bool):
    """An advisory lock on `path` that the OS releases when its holder exits, however it exits."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import(name: str, so: Path):
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def extension():
    """The compiled module (decode kernel, fused element-wise ops, int8 Linear), or None without a compiler."""
    from torch.utils.cpp_extension import load

    # -march=native: the build is keyed by the CPU's flags, so a cache shared between
    # machines never hands one CPU's instructions to another. -ffast-math lets the compiler
    # vectorize the dot products' sums and exp (glibc's vector math); the kernel has no
    # infinities or NaNs to lose (it visits only the tokens in context). -fopenmp: ATen's
    # parallel_for is OpenMP inside the headers; without it the kernel ran on one thread.
    cflags, ldflags = ["-O3", "-march=native", "-ffast-math", "-fopenmp"], ["-fopenmp"]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + torch.__version__.encode()
                         + sys.version.encode() + _cpu_flags().encode() + " ".join(cflags).encode()).hexdigest()[:12]
    name = f"quantpipe_paged_decode_{key}"
    build = build_directory(name)
    flock, so, ready = build.with_name(name + ".flock"), build / f"{name}.so", build / "ready"
    try:
        build.mkdir(parents=True, exist_ok=True)
        # Built before (`ready` is written only after a build under the exclusive lock has
        # loaded): import it under a shared lock, which waits only for a build in progress.
        # Processes starting at once (a server's, a canary's two sides, tests beside them)
        # neither queue behind each other nor run ninja again.
        with _locked(flock, exclusive=False):
            if ready.exists() and so.exists():
                return _import(name, so)
        # torch guards a build with a `lock` file that its builder deletes when done; a builder
        # killed mid-build leaves it behind and every later load waits on it forever. Ours is
        # released by the OS when its holder dies: holding it, no other process is building
        # here, so a `lock` file found now is stale.
        with _locked(flock, exclusive=True):
            (build / "lock").unlink(missing_ok=True)
            module = load(name, [str(p) for p in SOURCES], extra_cflags=cflags, extra_ldflags=ldflags,
                          build_directory=str(build), verbose=False)
            ready.touch()
            return module
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: the torch path still works
        log.warning("CPU kernels unavailable (%s): decode attention uses gather + GEMMs, element-wise ops "
                    "and W8A16 decode torch's",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None
