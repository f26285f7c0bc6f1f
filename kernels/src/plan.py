"""kernels.json: what `quantpipe kernels build` chose for an artifact, and whether to trust it.

Importable without triton: the runtime reads the plan first and imports the kernels
only when the plan holds for this device and Triton version.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from quantpipe.formats.packing import container_bits
from quantpipe.kernels.configs import GemmConfig, bucket_for

log = logging.getLogger("quantpipe.kernels")

PLAN_FILE = "kernels.json"
CACHE_DIR = "triton_cache"  # Triton's compiled kernels, kept beside the plan so a restart does not recompile
PLAN_FORMAT = "quantpipe-kernels/1"


def scheme_name(bits: int, act_bits: int | None) -> str:
    return f"W{bits}A{act_bits or 16}"


def case_key(kernel: str, scheme: str, group_size: int | None, symmetric: bool, n: int, k: int) -> str:
    """One matmul case: the kernel, the weight format and the shape ([N, K] as the runtime fuses them)."""
    return f"{kernel}/{scheme}/{'g' + str(group_size) if group_size else 'channel'}/" \
           f"{'sym' if symmetric else 'asym'}/{n}x{k}"


SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUPS = (32, 64, 128, None)  # None: per output channel


def unsupported_reason(bits: int, group_size: int | None, k: int) -> str | None:
    """Why the mixed-input GEMM has no kernel for this weight format (None: it has one)."""
    if bits not in SUPPORTED_BITS:
        return f"{bits}-bit weights (the mixed-input GEMM takes 4 or 8)"
    if group_size not in SUPPORTED_GROUPS:
        return f"group size {group_size} (the mixed-input GEMM takes 32, 64, 128 or per channel)"
    if group_size and k % group_size:
        return f"group size {group_size} does not divide K={k}"
    return None


def weight_case(qw) -> tuple[str, str, str | None]:
    """A QuantWeight's (case key, kernel, reason it has none or None). Weights of fewer bits
    are the case of the width that holds them (`container_bits`: W3 is a W4A16 case)."""
    n, k = qw.q.shape
    bits = qw.num_bits if qw.act_bits is not None else container_bits(qw.num_bits)
    scheme = scheme_name(bits, qw.act_bits)
    if qw.act_bits is not None:
        kernel = "w8a8_gemm"
        reason = None if (qw.num_bits, qw.group_size, qw.zero) == (8, None, None) else \
            f"{scheme} with {'group ' + str(qw.group_size) if qw.group_size else 'channel'} " \
            f"{'asymmetric' if qw.zero is not None else 'symmetric'} weights (the INT8 GEMM takes " \
            f"per-channel symmetric ones)"
    else:
        kernel = "mixed_gemm"
        reason = unsupported_reason(bits, qw.group_size, k)
    return case_key(kernel, scheme, qw.group_size, qw.zero is None, n, k), kernel, reason


def triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass
class KernelPlan:
    """Per case key, the config chosen for each batch bucket."""

    cases: dict[str, dict[int, GemmConfig]]

    def configs(self, key: str) -> dict[int, GemmConfig] | None:
        return self.cases.get(key)

    @staticmethod
    def pick(configs: dict[int, GemmConfig], rows: int) -> GemmConfig:
        return configs[bucket_for(rows, list(configs))]

    def linear_for(self, qw) -> tuple[object | None, str, str | None]:
        """(factory(qw, bias, dtype, kernels=...) -> module, case key, why not): the Triton
        module for this weight's case, or None with the reason when the plan has no config
        for it. The runtime asks this; it imports no kernel itself."""
        key, kernel, reason = weight_case(qw)
        configs = self.configs(key)
        if configs is None:
            return None, key, reason or "not in kernels.json (built for another artifact?)"
        from quantpipe.kernels.linear import TritonMixedLinear, TritonW8A8Linear

        cls = TritonMixedLinear if kernel == "mixed_gemm" else TritonW8A8Linear
        return (lambda q, bias, dtype, kernels=None: cls(q, bias, dtype, configs)), key, None


def plan_for(model: str | None, device) -> KernelPlan | None:
    """The plan a quantized artifact recorded for this CUDA device (None for other models or
    devices, or when the artifact has none for this device: said by load_plan)."""
    import torch

    from quantpipe.runtime.model.loader import resolve_model_path

    if torch.device(device).type != "cuda":
        return None
    try:
        path = Path(resolve_model_path(model))
    except (ValueError, OSError):
        return None  # not a path this can read: the loader says what is wrong with it
    try:
        quantized = path.is_dir() and "quantization_config" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader says what is wrong with it
    if not quantized:
        return None
    return load_plan(path, torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


def load_plan(artifact: str | Path, device_name: str, capability: tuple[int, int]) -> KernelPlan | None:
    """The artifact's plan if it was built for this device and Triton version; else None, said once."""
    path = Path(artifact) / PLAN_FILE
    if not path.exists():
        log.warning("%s has no %s: quantized layers use the torch fallback (run `quantpipe kernels build %s`)",
                    artifact, PLAN_FILE, artifact)
        return None
    try:
        data = json.loads(path.read_text())
        built_for = data["device"]
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {PLAN_FORMAT!r}")
        cases = {c["key"]: {int(b): GemmConfig.from_dict(v["config"]) for b, v in c["buckets"].items()}
                 for c in data["cases"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s is unreadable (%s): it is ignored and the torch fallback used", path, e)
        return None
    mismatch = []
    if built_for.get("name") != device_name:
        mismatch.append(f"device {built_for.get('name')!r}, this is {device_name!r}")
    if tuple(built_for.get("capability") or ()) != tuple(capability):
        mismatch.append(f"capability {built_for.get('capability')}, this is {list(capability)}")
    if data.get("triton") != triton_version():
        mismatch.append(f"Triton {data.get('triton')}, this is {triton_version()}")
    if mismatch:
        log.warning("%s was built for another setup (%s): it is ignored and the torch fallback used; rebuild it "
                    "with `quantpipe kernels build %s`", path, "; ".join(mismatch), artifact)
        return None
    return KernelPlan(cases)
