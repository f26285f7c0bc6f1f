"""Triton kernels matched to quantpipe's artifact formats, each beside its plain-torch reference.

- `mixed_gemm`: W4A16 / W8A16, bf16/fp16 activations times packed integer weights
  (compressed-tensors' `weight_packed`), dequantized in registers with group scales and
  zero points; one kernel covers GEMV (split-K) and prefill-sized GEMM through its config.
- `int8_gemm`: W8A8, the fused per-token activation quantization and the INT8 x INT8 GEMM.
- `paged_attention`: decode attention straight from the paged KV cache (bf16 or INT8,
  dequantized on load), and the write path that quantizes new K/V into their slots.
- `reference`: the same semantics in plain torch (the tests' judge, the runtime's fallback).
- `build`: the `quantpipe kernels build` stage (cases, verification, autotuning, kernels.json).

Importing these modules needs `triton`; on a machine without a GPU, set TRITON_INTERPRET=1
before importing them to run the kernels in Triton's interpreter on CPU tensors.
"""
