"""Quantized Linear modules that run the Triton kernels with the configs kernels.json chose."""

from __future__ import annotations

import torch
from torch import nn

from quantpipe.formats.artifact import QuantWeight
from quantpipe.formats.packing import container_bits, pack_int32
from quantpipe.kernels.configs import GemmConfig, bucket_for
from quantpipe.kernels.int8_gemm import w8a8_gemm
from quantpipe.kernels.mixed_gemm import mixed_gemm


class _TritonLinear(nn.Module):
    """Shapes, bias and the per-bucket config choice; subclasses hold the weights and call their kernel."""

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 configs: dict[int, GemmConfig]):
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.configs = configs
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def matmul(self, x: torch.Tensor, config: GemmConfig) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = self.matmul(x2, self.configs[bucket_for(x2.shape[0], list(self.configs))]).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class TritonMixedLinear(_TritonLinear):
    """W4A16 / W8A16 through the mixed-input GEMM, weights packed as compressed-tensors stores them
    (fewer bits in the 4- or 8-bit layout that holds them)."""

    kernel = "triton-mixed"

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 configs: dict[int, GemmConfig]):
        super().__init__(qw, bias, dtype, configs)
        self.bits, self.group_size = container_bits(qw.num_bits), qw.group_size
        self.register_buffer("weight_packed", pack_int32(qw.q, self.bits))
        self.register_buffer("weight_scale", qw.scale.float().contiguous())
        self.register_buffer("weight_zero", None if qw.zero is None else qw.zero.float().contiguous())

    def matmul(self, x: torch.Tensor, config: GemmConfig) -> torch.Tensor:
        return mixed_gemm(x, self.weight_packed, self.weight_scale, self.weight_zero, self.bits, self.group_size,
                          config)


class TritonW8A8Linear(_TritonLinear):
    """W8A8 through the fused per-token quantization and the INT8 GEMM."""

    kernel = "triton-w8a8"

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 configs: dict[int, GemmConfig]):
        super().__init__(qw, bias, dtype, configs)
        self.register_buffer("weight_q", qw.q.contiguous())
        self.register_buffer("weight_scale", qw.scale.reshape(-1).float().contiguous())

    def matmul(self, x: torch.Tensor, config: GemmConfig) -> torch.Tensor:
        return w8a8_gemm(x, self.weight_q, self.weight_scale, config)
