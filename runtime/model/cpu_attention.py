"""The CPU paged decode kernel (csrc/paged_decode.cpp), compiled once per machine on first use,
in one module with the fused bf16 element-wise ops (csrc/elementwise.cpp, fused_elementwise.py)
and the W8A16 decode kernel (csrc/int8_linear.cpp, quantized.Int8PackLinear).

It reads K/V straight from their blocks, where the torch path gathers them into a padded
copy and lays them out for two GEMMs (benchmarks/bench_decode_attention.py, BENCHMARKS.md).
Compiling needs a C++ compiler (torch.utils.cpp_extension, about 40 s, cached per source,
torch version and CPU); without one the torch path is used and that is said once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
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
                         + _cpu_flags().encode() + " ".join(cflags).encode()).hexdigest()[:12]
    try:
        return load(f"quantpipe_paged_decode_{key}", [str(p) for p in SOURCES], extra_cflags=cflags,
                    extra_ldflags=ldflags, verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: the torch path still works
        log.warning("CPU kernels unavailable (%s): decode attention uses gather + GEMMs, element-wise ops "
                    "and W8A16 decode torch's",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None
