"""Which of the runtime's own CPU kernels a model runs: all by default, each one can be turned
off (engine argument `disable_cpu_kernels`, `--disable-cpu-kernels` on `quantpipe serve`).

A kernel turned off gives its layers back to torch's path, with the same outputs (each
kernel is tested against that path); the switches exist to measure a kernel against that
path and to step round a kernel that misbehaves on some CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

CPU_KERNELS = {
    "attention": "paged decode attention read from the KV blocks (torch: gather + two GEMMs)",
    "fused-elementwise": "bf16 RMSNorm and SiLU-mul fused (torch: separate ops)",
    "prepack": "bf16 Linear weights prepacked for oneDNN on AVX-512 BF16 CPUs (torch: F.linear)",
    "blocked-gemm": "float32 wide Linear layers in row blocks at few rows (torch: one F.linear)",
    "int8": "W8A16 and W8A8 bf16 decode kernel (torch: _weight_int8pack_mm; W8A8 holds bf16 weights and takes F.linear)",
    "packed": "float32 serving of W8/W4 weights kept packed, and bf16 serving of W5-W8 by group "
              "(torch: weights dequantized at load)",
}


@dataclass(frozen=True)
class CpuKernels:
    """The set of CPU kernels turned off; everything else runs where its case applies."""

    disabled: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, value: str | Iterable[str] | None, key: str = "disable_cpu_kernels") -> CpuKernels:
        """From a comma-separated string or a list of names; an unknown name is an error naming `key`."""
        if value is None:
            return cls()
        items = value.split(",") if isinstance(value, str) else list(value)
        names = set()
        for item in items:
            if not isinstance(item, str):
                raise ValueError(f"{key}: entries must be kernel names, got {item!r}")
            for name in item.split(","):
                name = name.strip()
                if not name:
                    continue
                if name not in CPU_KERNELS:
                    raise ValueError(f"{key}: unknown CPU kernel {name!r}; choose from {', '.join(CPU_KERNELS)}")
                names.add(name)
        return cls(frozenset(names))

    def enabled(self, name: str) -> bool:
        if name not in CPU_KERNELS:
            raise KeyError(name)
        return name not in self.disabled


ALL_ON = CpuKernels()


def help_text() -> str:
    """One line per kernel, for --help."""
    return "; ".join(f"{name}: {what}" for name, what in CPU_KERNELS.items())
