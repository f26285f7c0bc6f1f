"""Layer-streamed quantization: models larger than memory, one decoder layer at a time.

`quantpipe quantize --max-memory SIZE` builds the model's skeleton without weights, reads
each decoder layer's tensors from the source when its turn comes (safetensors shards or a
GGUF file, `loader.LazyWeights`), quantizes it (RTN, GPTQ, AWQ, AutoRound) on the
calibration activations that the layers before it produced, writes its tensors to the
artifact and lets it go. What stays resident is one layer in float32, its Hessians, the
calibration activations (GPTQ's and AWQ's on disk when they would not fit beside the rest;
AutoRound draws its mini-batches from them at random and keeps them in memory), and the
checkpoint shard being written. The embeddings are read in row ranges: calibration keeps
only the rows of the tokens it uses, and the artifact's copy is converted range by range.

The output is the whole-model path's, byte for byte, given the same `--max-shard-size`
(tests/quantize/test_stream.py): the same layers see the same inputs in the same order, and
both write through one `CheckpointWriter`. Streamed, the default shard size is at most an
eighth of the budget, so a large model's files (and artifact hash) differ from a whole-model
run's with its 5 GB default; the manifest records the size. The plan is checked before any
layer is read, and the process's peak resident memory after every layer: past the budget,
the stage stops with an error and writes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.manifest import StageError

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


def parse_size(text: str, option: str) -> int:
    """'1.5GB', '1536MiB', '800mb' or a byte count -> bytes (transformers' max_shard_size spelling)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS:
        raise StageError(f"{option} {text!r}: give a size such as 1.5GB, 1536MiB or a byte count")
    size = int(float(m[1]) * _UNITS[m[2].lower()])
    if size <= 0:
        raise StageError(f"{option} {text!r}: must be more than 0 bytes")
    return size


def mib(n: float) -> int:
    return round(n / 1024 ** 2)


def resident_bytes() -> tuple[int, int]:
    """(current, peak) resident set of this process, from /proc (the kernel's own high-water
    mark); without /proc, the peak getrusage reports, for both."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields["VmRSS"], fields["VmHWM"]
    except (OSError, KeyError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return peak, peak


def reset_peak() -> None:
    """Start the kernel's resident high-water mark afresh, so the peak a streamed run reports
    and checks is its own, not that of whatever this process did before (Linux's clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not permitted: the peak then counts from the process's start
        pass


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:  # not glibc: its allocator is left as it is
        return None


M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 * 1024 * 1024


def map_large_allocations() -> None:
    """Serve every allocation of 4 MiB or more with its own mapping, returned to the system
    when freed. glibc otherwise raises that threshold as large blocks are freed (up to 32 MiB)
    and serves a layer's temporaries from its heap, between the small tensors a checkpoint
    shard keeps: the freed pages stay in the process's data segment, which grew by about 20
    MiB a layer (2.5 GB model, RTN) until the memory limit refused an allocation. 4 MiB, not
    less: each mapping is zeroed by the kernel, and at 256 KiB a 16-layer GPTQ spent 35 s in
    the kernel against 24 s (BENCHMARKS.md, "Models larger than memory")."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (what the mapping threshold leaves there)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class Activations:
    """The calibration sequences' hidden states between two layers, in memory or, when
    `folder` is given, one file per sequence (read back one at a time)."""

    def __init__(self, tensors, folder: Path | None = None):
        self.folder = folder
        self._gen = 0
        self._items: list = []
        self.replace(tensors)

    def _path(self, gen: int, k: int) -> Path:
        return self.folder / f"{gen}-{k}.pt"

    def __iter__(self):
        for k, x in enumerate(self._items):
            yield torch.load(self._path(self._gen, k)) if x is None else x

    def replace(self, tensors) -> Activations:
        """The next layer's inputs (an iterable, consumed as it is written)."""
        if self.folder is None:
            self._items = list(tensors)
            return self
        old, gen, n = self._gen, self._gen + 1, 0
        for k, x in enumerate(tensors):
            torch.save(x.contiguous(), self._path(gen, k))
            n += 1
        for k in range(len(self._items)):
            self._path(old, k).unlink(missing_ok=True)
        self._gen, self._items = gen, [None] * n
        return self


@dataclass
class MemoryPlan:
    """What layer-streamed quantization will hold at its peak, against the budget."""

    budget: int
    baseline: int  # the process before any layer is read
    layer: int  # the largest decoder layer in float32, plus the working copies of its largest Linear
    hessians: int  # the largest layer's Hessians (float64 while accumulated, float32 kept)
    activations: int  # two generations of every calibration sequence's hidden states
    shard: int  # the checkpoint shard held until it is written, or the largest group past it
    sequences: int = 1
    on_disk: bool = False

    def fixed(self) -> int:
        return self.baseline + self.layer + self.hessians + self.shard

    def total(self) -> int:
        # On disk: one sequence read and one written at a time.
        return self.fixed() + (self.activations // max(self.sequences, 1) if self.on_disk else self.activations)

    def describe(self) -> dict:
        return {"budget_mib": mib(self.budget), "baseline_mib": mib(self.baseline), "layer_mib": mib(self.layer),
                "hessians_mib": mib(self.hessians), "activations_mib": mib(self.activations),
                "shard_mib": mib(self.shard), "activations_on": "disk" if self.on_disk else "memory",
                "estimate_mib": mib(self.total())}


def plan_memory(budget: int, layer_bytes: int, largest_linear: int, hessian_bytes: int, activation_bytes: int,
                sequences: int, shard_bytes: int, spill: bool = True) -> MemoryPlan:
    """The plan for `budget` bytes, activations moved to disk when they would not fit in
    memory (where `spill`); a StageError naming the largest part when even that does not fit."""
    current, _ = resident_bytes()
    plan = MemoryPlan(budget, current, layer_bytes + 3 * largest_linear, hessian_bytes, 2 * activation_bytes,
                      shard_bytes, sequences=sequences)
    if plan.total() > budget and spill:
        plan.on_disk = True
    if plan.total() > budget:
        parts = {"the process before any layer": plan.baseline, "one decoder layer in float32": plan.layer,
                 "its Hessians": plan.hessians, "the checkpoint shard being written": plan.shard}
        if not plan.on_disk:
            parts["the calibration activations (kept in memory)"] = plan.activations
        big = max(parts, key=parts.get)
        raise StageError(f"--max-memory {mib(budget)} MiB is too small for this model: the plan needs about "
                         f"{mib(plan.total())} MiB ({', '.join(f'{k} {mib(v)} MiB' for k, v in parts.items())}); "
                         f"the largest part is {big}" + (" (lower --max-shard-size)" if big.startswith("the check")
                                                         else ""))
    return plan


class StreamedLayers:
    """Decoder layers read from the source when their turn comes and released after it."""

    def __init__(self, net, lazy, budget: int, on_load=None):
        self.net, self.lazy, self.budget, self.on_load = net, lazy, budget, on_load

    def load(self, i: int) -> None:
        """Layer i's weights from the source, then `on_load(i, layer)` (the run's rotations)."""
        layer = self.net.layers[i]
        state = {k: self.lazy.get(f"layers.{i}.{k}") for k in layer.state_dict()}
        layer.load_state_dict(state, strict=True, assign=True)
        self.lazy.release()
        if self.on_load is not None:
            self.on_load(i, layer)

    def free(self, i: int) -> None:
        self.net.layers[i].to("meta")
        release_freed_memory()
        _, peak = resident_bytes()
        if peak > self.budget:
            raise StageError(f"--max-memory {mib(self.budget)} MiB: the process's resident memory reached "
                             f"{mib(peak)} MiB by layer {i} (the plan's estimate was under the budget); "
                             f"nothing was written")


class ResidentLayers:
    """The whole model is in memory: nothing to read or release."""

    def load(self, i: int) -> None:
        pass

    def free(self, i: int) -> None:
        pass


def spill_folder(out: str) -> tempfile.TemporaryDirectory:
    """A scratch folder beside the artifact's (on the same disk) for activations moved out of memory."""
    parent = Path(os.path.abspath(out)).parent
    return tempfile.TemporaryDirectory(prefix=".activations-", dir=parent)
