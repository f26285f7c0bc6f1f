"""Quantized Linear modules and the handler that swaps them into a loaded model.

The model code never learns about quantization (gpt-fast's shape): the loader builds
the model as usual, then `swap_linears` replaces each quantized `nn.Linear` with the
module the artifact's format calls for. The kernel is chosen from the format, never
guessed, and each choice is logged once at load:

Weights of fewer bits take the kernel of the next width up, exactly (their integers are a
subset of its range, with the same scales and zero points): W2 and W3 the 4-bit kernels,
W5 to W7 the 8-bit ones.

- `int8pack`: W8 per output channel, symmetric or with a zero point per channel -> up to 16
  rows quantpipe's CPU kernel (csrc/int8_linear.cpp, the zero point as z * sum(x) in its
  float32 sums; torch._weight_int8pack_mm where it cannot be built, which takes symmetric
  weights only), past that the dense GEMM on the integer values (less the zero point: exact
  in bf16, |q - z| <= 255)
- `int4pack`: W4 with a group size of 32/64/128/256 dividing K -> torch's CPU int4 mm
  (its zero convention, w = (u - 8) * scale + zero with a float zero, is converted from
  compressed-tensors' integer zero point at load)
- `packed-f32`: float32 models on CPU (where the CPU has no native bf16), W8 per channel or
  by group and W4 by group, K a multiple of 32 -> quantpipe's CPU kernel
  (csrc/packed_linear.cpp): the weights stay at their packed size and are widened in
  cache-sized tiles where they are multiplied, at every row count; bf16 models too for
  W5-W8 by group (activations widened to float32, the product rounded back)
- `w8a8`: INT8 weights and per-token INT8 activations (W8A8); on CPU its integer weights
  stay int8 and go through the packed kernel (float32) or the int8 kernel (bf16, decode rows)
- `triton-mixed` / `triton-w8a8` (CUDA): the Triton kernels of quantpipe.kernels with the
  configs `quantpipe kernels build` chose and recorded in the artifact's kernels.json
- `dequant`: anything else (bf16 with W2-W4 group sizes int4pack lacks, CUDA without a
  kernels.json built for the device, no C++ compiler): weights dequantized once to the
  model dtype, then plain F.linear.

torch's CPU int kernels are fast only with bf16 activations: with float32 ones they ran
10-60x slower than float32 F.linear (measured), so a float32 model takes `packed-f32`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from quantpipe.formats.artifact import QuantWeight
from quantpipe.formats.packing import container_bits
from quantpipe.runtime.model.cpu_kernels import ALL_ON, CpuKernels

log = logging.getLogger("quantpipe.runtime")

INT4_GROUPS = (32, 64, 128, 256)
# The int8 kernels are matrix-vector products at heart: against bf16 F.linear on the
# default model's shapes torch's ran 2.3-3x faster at 1 row, about even at 8, and 3-4x
# slower from 128 rows (a prefill chunk). Past this many rows the int8 weights are
# converted to the activation dtype and go through the dense GEMM: 1.1-1.2x bf16's time at
# 512 rows (benchmarks/bench_int_kernels.py, BENCHMARKS.md). quantpipe's own kernel, which
# takes these rows where it is built, costs the same as the dense path at about 24 rows.
INT8PACK_MAX_ROWS = 16


def int8_kernel(kernels: CpuKernels = ALL_ON):
    """The compiled CPU int8 kernel module, or None (no compiler, no AVX-512, or the `int8`
    CPU kernel turned off: then torch's _weight_int8pack_mm takes its rows)."""
    if not kernels.enabled("int8"):
        return None
    from quantpipe.runtime.model.cpu_attention import extension

    ext = extension()
    return ext if ext is not None and ext.int8_linear_vectorized() else None


def packed_kernel(kernels: CpuKernels = ALL_ON):
    """The compiled CPU module whose packed_linear_f32 serves float32 models and the
    W5-W8-by-group layers of bf16 ones, or None (no compiler, or the `packed` CPU kernel
    turned off: then those layers take `dequant`)."""
    if not kernels.enabled("packed"):
        return None
    from quantpipe.runtime.model.cpu_attention import extension

    return extension()


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> [N, K / 2] in the packed kernel's 4-bit layout: byte i of
    each 16 carries value i of its 32 in the low nibble and value 16 + i in the high one."""
    n, k = u.shape
    c = u.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class Int8PackLinear(nn.Module):
    kernel = "int8pack"

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: CpuKernels = ALL_ON):
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.register_buffer("weight_int8", qw.q.contiguous())
        self.register_buffer("scales", qw.scale.reshape(-1).to(dtype).contiguous())
        # Asymmetric grids: w = (q - zero) * scale, one integer zero point per output channel.
        self.register_buffer("zeros", None if qw.zero is None else qw.zero.reshape(-1).float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        # torch's int8 kernel streamed the weights at 2/3 of the rate the bf16 and int4 ones
        # reached (no prefetching); ours reads them ahead. bf16 activations on CPU only.
        self.ext = int8_kernel(kernels) if dtype == torch.bfloat16 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        small = x2.shape[0] <= INT8PACK_MAX_ROWS
        if small and self.ext is not None and x2.dtype == torch.bfloat16 and x2.is_cpu:
            y = self.ext.int8_linear_bf16(x2, self.weight_int8, self.scales, self.zeros)
        elif small and self.zeros is None:
            y = torch._weight_int8pack_mm(x2, self.weight_int8, self.scales.to(x.dtype))
        else:  # prefill-sized: the dense GEMM on the integer values (exact in bf16), scaled per output
            w = self.weight_int8.to(x.dtype)
            if self.zeros is not None:  # in place: the converted copy is this call's own
                w.sub_(self.zeros.to(x.dtype).unsqueeze(1))
            y = F.linear(x2, w) * self.scales.to(x.dtype)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4PackLinear(nn.Module):
    kernel = "int4pack"

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: CpuKernels = ALL_ON):
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.group_size = qw.group_size
        u = (qw.q.to(torch.int32) + 8).contiguous()  # 0..15, the op's unsigned nibbles
        self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(u, 1))
        scale = qw.scale.float()
        zero = torch.zeros_like(scale) if qw.zero is None else -qw.zero.float() * scale
        # [K / group, N, 2]: (scale, zero) per group and output channel.
        self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], -1).to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), self.weight_int4, self.group_size,
                                              self.scales_zeros.to(x.dtype))
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class PackedLinear(nn.Module):
    """W8 or W4 weights at their packed size for a float32 model on CPU (csrc/packed_linear.cpp).

    The kernel widens the integers to float32 and applies w = (u - zero) * scale per group
    before multiplying: the same product as `dequant`'s weights, without holding them. A
    bf16 model uses it for 5- to 8-bit weights by group, which torch has no bf16 kernel for:
    its activations are widened to float32 and the product rounded back to bf16, so the
    weights stay at one byte each instead of being dequantized to two.
    """

    kernel = "packed-f32"

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: CpuKernels = ALL_ON):
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.bits = container_bits(qw.num_bits)
        groups = 1 if qw.group_size is None else self.in_features // qw.group_size
        zero = torch.zeros_like(qw.scale, dtype=torch.float32) if qw.zero is None else qw.zero.float()
        if self.bits == 4:  # stored unsigned: u = q + 8, so the zero point moves by 8 too
            self.register_buffer("weight_packed", pack_nibbles(qw.q.to(torch.int16) + 8))
            zero = zero + 8
        else:
            self.register_buffer("weight_packed", qw.q.contiguous())
        self.register_buffer("scales", qw.scale.float().reshape(self.out_features, groups).contiguous())
        self.register_buffer("zeros", None if qw.zero is None and self.bits == 8
                             else zero.reshape(self.out_features, groups).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.ext = packed_kernel(kernels)
        if self.ext is None:  # only a forced kernel gets here (kernel_for asks first)
            raise ValueError("kernel packed-f32: quantpipe's CPU module is not built here, or the "
                             "`packed` CPU kernel is turned off")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.ext.packed_linear_f32(x.reshape(-1, shape[-1]).float(), self.weight_packed, self.bits, self.scales,
                                       self.zeros)
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class W8A8Linear(nn.Module):
    """INT8 weights per channel, activations quantized per token (dynamic, symmetric) on the fly.

    The integer product runs as a float matmul of the integer values: torch's CPU
    `_int_mm` measured 30x slower than float32 F.linear here, and the result is the same
    function (the Triton INT8 GEMM of quantpipe.kernels takes this on CUDA). Served in
    bf16 on a CPU where quantpipe's int8 kernel is built, the weights stay int8 and the
    integer activations (exact in bf16's 8 significant bits) go through that kernel at
    decode-sized row counts (unit scales: the product of the integers, rounded to bf16 as any
    bf16 Linear's output is), and through the bf16 GEMM on the weights converted per call past
    INT8PACK_MAX_ROWS. Without that kernel (or with `int8` turned off) the weights are held as
    bf16 values and every row count takes the bf16 GEMM: the same function, but as many
    weight bytes as the unquantized model and 0.60x its decode rate (BENCHMARKS.md).
    """

    kernel = "w8a8"

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: CpuKernels = ALL_ON):
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.gemm_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        # float32 on CPU: the integer weights stay int8 and the packed kernel widens them.
        self.ext = packed_kernel(kernels) if self.gemm_dtype == torch.float32 and self.in_features % 32 == 0 else None
        # bf16 on CPU: the int8 weights kept as they are, for quantpipe's int8 kernel.
        self.int8 = int8_kernel(kernels) if self.gemm_dtype == torch.bfloat16 else None
        keep_int8 = self.ext is not None or self.int8 is not None
        weight_q = qw.q.contiguous() if keep_int8 else qw.q.to(self.gemm_dtype).contiguous()
        self.register_buffer("weight_q", weight_q)  # integer values, exact
        self.register_buffer("weight_scale", qw.scale.reshape(-1).float().contiguous())
        self.register_buffer("unit", None if self.int8 is None else torch.ones(self.out_features, dtype=torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1]).float()
        xq, xs = quantize_per_token(xf)
        if (self.ext is not None or self.int8 is not None) and not xq.is_cpu:  # moved off the CPU: converted once
            self.ext, self.int8, self.weight_q = None, None, self.weight_q.to(self.gemm_dtype)
        # The integer product, then both scales.
        if self.ext is not None:
            acc = self.ext.packed_linear_f32(xq, self.weight_q, 8)
        else:
            xg = xq.to(self.gemm_dtype)
            if self.int8 is not None and xg.shape[0] <= INT8PACK_MAX_ROWS:
                acc = self.int8.int8_linear_bf16(xg, self.weight_q, self.unit, None)
            else:  # int8 weights held for the kernel are converted per call; bf16 ones as they are
                acc = F.linear(xg, self.weight_q.to(self.gemm_dtype))
        y = (acc.float() * xs * self.weight_scale).to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_per_token(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: (integer values as float, scale [rows, 1]).

    compressed-tensors' grid, which llm-compressor's W8A8 checkpoints are calibrated for:
    the scale maps max|x| to half the integer range (127.5 for int8), values clamp to [-128, 127].
    """
    q_max = (1 << (bits - 1)) - 1
    scale = (x.abs().amax(-1, keepdim=True) / (q_max + 0.5)).clamp(min=1e-10)
    return torch.round(x / scale).clamp(-q_max - 1, q_max), scale


class DequantLinear(nn.Linear):
    """Dequantized once at load: the fallback for formats without a fast kernel here."""

    kernel = "dequant"

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: CpuKernels = ALL_ON):
        n, k = qw.q.shape
        super().__init__(k, n, bias=bias is not None, device="meta")
        self.weight = nn.Parameter(qw.dequantize(dtype), requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias.to(dtype), requires_grad=False)


def kernel_for(qw: QuantWeight, device: torch.device, dtype: torch.dtype,
               kernels: CpuKernels = ALL_ON) -> type[nn.Module]:
    """The module for this weight format on this device: a fast kernel, or the fallback."""
    n, k = qw.q.shape
    if qw.act_bits is not None:
        return W8A8Linear  # activations must be quantized too: the same function on every path
    if device.type != "cpu":
        return DequantLinear  # CUDA: the Triton kernels of quantpipe.kernels, once built
    packable = k % 32 == 0 and packed_kernel(kernels) is not None  # what PackedLinear needs
    if dtype == torch.float32:
        return PackedLinear if packable else DequantLinear
    if dtype != torch.bfloat16:
        return DequantLinear
    bits = container_bits(qw.num_bits)
    if bits == 8 and qw.group_size is None:
        return Int8PackLinear
    if bits == 4 and qw.group_size in INT4_GROUPS and k % qw.group_size == 0 and n % 16 == 0:
        return Int4PackLinear
    if bits == 8 and packable:
        return PackedLinear  # by group: float32 products of one-byte weights (PackedLinear's text)
    return DequantLinear


def _triton_module(qw: QuantWeight, plan, missing: dict[str, str]):
    """A factory for the Triton module of this weight's case in `plan`, or None (recorded in `missing`)."""
    make, key, reason = plan.linear_for(qw)
    if make is None:
        missing[key] = reason
    return make


def swap_linears(model: nn.Module, weights: dict[str, QuantWeight], dtype: torch.dtype,
                 device: torch.device, force_kernel: str | None = None, plan=None,
                 cpu_kernels: CpuKernels = ALL_ON) -> dict[str, str]:
    """Replace model.<name> (an nn.Linear) by a quantized module for each entry; returns name -> kernel.

    `plan` (a quantpipe.kernels KernelPlan, CUDA only) runs its cases through the Triton kernels
    it names (`plan.linear_for`); a case it lacks takes the fallback below, said once per case.
    """
    kinds = {"int8pack": Int8PackLinear, "int4pack": Int4PackLinear, "packed-f32": PackedLinear,
             "dequant": DequantLinear, "w8a8": W8A8Linear}
    chosen: dict[str, str] = {}
    missing: dict[str, str] = {}
    for name, qw in weights.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{name} is not a Linear layer")
        if tuple(qw.q.shape) != (old.out_features, old.in_features):
            raise ValueError(f"{name}: quantized weight has shape {tuple(qw.q.shape)}, "
                             f"the layer is {(old.out_features, old.in_features)}")
        cls = kinds[force_kernel] if force_kernel and qw.act_bits is None else kernel_for(qw, device, dtype, cpu_kernels)
        make = cls
        if plan is not None and not force_kernel:
            make = _triton_module(qw, plan, missing) or cls
        bias = None if old.bias is None or old.bias.is_meta else old.bias.detach()
        module = make(qw, bias, dtype, kernels=cpu_kernels).to(device)
        setattr(parent, attr, module)
        chosen[name] = module.kernel
    for key, reason in missing.items():
        log.warning("no Triton kernel for %s (%s): its layers use the torch fallback", key, reason)
    summary: dict[str, int] = {}
    for k in chosen.values():
        summary[k] = summary.get(k, 0) + 1
    log.info("quantized linears: %s", ", ".join(f"{n} via {k}" for k, n in sorted(summary.items())))
    return chosen
