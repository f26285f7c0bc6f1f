"""Packing, grids and GPTQ on single matrices, checked against compressed-tensors and a plain GPTQ."""

from __future__ import annotations

import pytest
import torch

from quantpipe.formats.artifact import QuantWeight
from quantpipe.formats.packing import pack_int32, unpack_int32
from quantpipe.quantize.gptq import gptq
from quantpipe.quantize.rtn import WeightScheme, dequantize, qparams, rtn


@pytest.fixture(scope="module")
def ct_helpers():
    """compressed-tensors' own packing helpers (a path inside the library: only the test that
    compares against them is skipped if a release moves it)."""
    return pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("k", [64, 70, 576])
def test_pack_round_trip_and_library_agreement(bits, k, ct_helpers):
    g = torch.Generator().manual_seed(k + bits)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (24, k), generator=g, dtype=torch.int8)
    packed = pack_int32(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (24, -(-k * bits // 32))
    assert torch.equal(unpack_int32(packed, bits, k), q)
    # Bit for bit what compressed-tensors writes, and we read what it writes.
    assert torch.equal(packed, ct_helpers.pack_to_int32(q, bits))
    assert torch.equal(unpack_int32(ct_helpers.pack_to_int32(q, bits), bits, k), q)
    assert torch.equal(pack_int32(q, bits, dim=0), ct_helpers.pack_to_int32(q, bits, packed_dim=0))
    assert torch.equal(unpack_int32(pack_int32(q, bits, dim=0), bits, 24, dim=0), q)


def test_dense_packing_places_each_value_at_its_bit_offset():
    """3-bit values 0..31 (offset 4 written as u = q + 4): value i sits at bits 3i.., value 10
    straddles words 0 and 1 (bits 30-32)."""
    u = torch.arange(32) % 8
    packed = pack_int32((u - 4).to(torch.int8).unsqueeze(0), 3)
    bits = "".join(format(int(w) & 0xFFFFFFFF, "032b")[::-1] for w in packed[0])
    assert packed.shape == (1, 3)
    assert bits == "".join(format(int(v), "03b")[::-1] for v in u)


def test_a_packed_tensor_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="70 3-bit values pack into 7 int32 words, got 8"):
        unpack_int32(torch.zeros(2, 8, dtype=torch.int32), 3, 70)


def test_out_of_range_values_are_refused():
    with pytest.raises(ValueError, match="4-bit range"):
        pack_int32(torch.full((2, 8), 8, dtype=torch.int8), 4)


@pytest.mark.parametrize("scheme", [WeightScheme(4, 64, True), WeightScheme(4, 32, False), WeightScheme(8, None, True),
                                    WeightScheme(8, 64, False), WeightScheme(3, 64, True), WeightScheme(6, 128, False)])
def test_library_decompresses_to_our_dequantized_weights(scheme):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    q, scale, zero = rtn(w, scheme)
    scale = scale.to(torch.bfloat16)
    ours = QuantWeight(q, scale.float(), zero, scheme.num_bits, scheme.group_size).dequantize(torch.bfloat16)
    state = {"weight_packed": pack_int32(q, scheme.num_bits), "weight_scale": scale,
             "weight_shape": torch.tensor([96, 256])}
    if zero is not None:
        state["weight_zero_point"] = pack_int32(zero.to(torch.int8), scheme.num_bits, dim=0)
    args = QuantizationArgs(num_bits=scheme.num_bits, type="int", symmetric=scheme.symmetric,
                            strategy="group" if scheme.group_size else "channel", group_size=scheme.group_size)
    theirs = PackedQuantizationCompressor.decompress(state, QuantizationScheme(targets=["Linear"], weights=args))
    assert torch.equal(theirs["weight"].to(torch.bfloat16), ours)


def test_rtn_grid_conventions():
    w = torch.tensor([[-1.0, 0.5, 0.25, 1.0] * 16])
    q, scale, zero = rtn(w, WeightScheme(4, 64, True))
    assert zero is None and q.min() >= -8 and q.max() <= 7
    assert torch.allclose(scale, torch.tensor([[1.0 / 7.5]]))  # max|w| / ((q_max - q_min) / 2)
    q, scale, zero = rtn(w, WeightScheme(4, 64, False))
    back = dequantize(q, scale, zero, WeightScheme(4, 64, False))
    assert (back - w).abs().max() <= scale.max() / 2 + 1e-6
    mse_q, mse_s, _ = rtn(torch.randn(8, 128), WeightScheme(4, 32, True), clip="mse")
    assert mse_q.shape == (8, 128) and mse_s.shape == (8, 4)


def _reference_gptq(w: torch.Tensor, h: torch.Tensor, scheme: WeightScheme, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The algorithm as written in the paper, unblocked: one column at a time, full updates."""
    w = w.clone().float()
    h = h.clone().double()
    h.diagonal().add_(damp * h.diagonal().mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    n, k = w.shape
    q = torch.zeros(n, k, dtype=torch.int8)
    gs = scheme.group_size
    scales = []
    for j in range(k):
        if j % gs == 0:
            span = scheme.q_max - scheme.q_min
            scale = (w[:, j:j + gs].abs().amax(1) / (span / 2)).clamp(min=1e-10)
            scales.append(scale)
        qj = torch.round(w[:, j] / scale).clamp(scheme.q_min, scheme.q_max)
        q[:, j] = qj.to(torch.int8)
        err = (w[:, j] - qj * scale) / hinv[j, j]
        w[:, j:] -= err.unsqueeze(1) * hinv[j, j:].unsqueeze(0)
    return q, torch.stack(scales, 1)


def test_gptq_beats_rtn_and_matches_the_plain_algorithm():
    g = torch.Generator().manual_seed(0)
    n, k = 64, 256
    w = torch.randn(n, k, generator=g)
    # Correlated inputs with a few loud channels, like real activations.
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(4096, k, generator=g) @ mix
    x[:, :8] *= 8
    x_train, x_test = x[:3072], x[3072:]
    h = 2 * x_train.t() @ x_train / len(x_train)
    scheme = WeightScheme(4, 64, True)
    q, scale, zero, used = gptq(w, h, scheme, dampening=0.01, block_size=128)
    assert used == 0.01 and zero is None
    q_rtn, s_rtn, _ = rtn(w, scheme)

    def err(qq, ss):
        return ((x_test @ w.t() - x_test @ dequantize(qq, ss, None, scheme).t()) ** 2).mean().item()

    assert err(q, scale) < 0.7 * err(q_rtn, s_rtn), (err(q, scale), err(q_rtn, s_rtn))
    ref, ref_scale = _reference_gptq(w, h, scheme, 0.01)
    # Blocking reorders float sums, so a rare near-tie rounds the other way (and its error
    # then flows on differently): nearly all values agree, and the output error matches.
    assert (q == ref).float().mean() > 0.98
    assert abs(err(q, scale) / err(ref, ref_scale) - 1) < 0.05


def test_gptq_act_order_keeps_groups_and_helps():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 128, generator=g)
    x = torch.randn(2048, 128, generator=g) * torch.linspace(0.1, 10, 128)
    h = 2 * x.t() @ x / len(x)
    scheme = WeightScheme(4, 32, True)
    q, scale, _, _ = gptq(w, h, scheme, act_order=True)
    q0, s0, _, _ = gptq(w, h, scheme, act_order=False)
    rtn_scale = rtn(w, scheme)[1]
    assert torch.allclose(scale, rtn_scale)  # static groups: the scales of the original order

    def err(qq, ss):
        return ((x @ w.t() - x @ dequantize(qq, ss, None, scheme).t()) ** 2).mean().item()

    assert err(q, scale) <= err(q0, s0) * 1.05


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, None), (3, 64), (6, 32)])
def test_gptq_after_a_clip_search_lowers_the_output_error(act_order, bits, group_size):
    """clip="mse" for GPTQ: each group's range shrink chosen by the layer's output error first
    (heavy-tailed weights, where min-max spends the grid on a few values), then GPTQ on those
    grids: lower error on held-out inputs, and the searched shrink is what the scales carry."""
    from quantpipe.quantize.awq import search_clip
    from quantpipe.quantize.stage import gptq_clip_shrinks

    g = torch.Generator().manual_seed(5)
    n, k = 64, 256
    w = torch.randn(n, k, generator=g) * torch.empty(n, k).exponential_(generator=g)  # heavy tails
    x = torch.randn(4096, k, generator=g) * torch.linspace(0.2, 4, k)
    x_train, x_test = x[:3072], x[3072:]
    h = 2 * x_train.t() @ x_train / len(x_train)
    scheme = WeightScheme(bits, group_size, True)
    shrink = search_clip(w, h, scheme, gptq_clip_shrinks(bits))
    assert shrink.shape == (n, scheme.groups(k)) and (shrink < 1).any()
    plain = gptq(w, h, scheme, act_order=act_order)
    clipped = gptq(w, h, scheme, act_order=act_order, shrink=shrink)

    def err(out):
        q, scale = out[0], out[1]
        return ((x_test @ w.t() - x_test @ dequantize(q, scale, None, scheme).t()) ** 2).mean().item()

    # Up to 4 bits the grid is coarse and clipping pays a lot; from 6, a few percent (as on the model).
    assert err(clipped) < (0.95 if bits <= 4 else 0.99) * err(plain), (err(clipped), err(plain))
    if act_order:  # static groups: the scales are the shrunk min-max ones
        assert torch.allclose(clipped[1], qparams(w, scheme, shrink)[0])


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 128), (8, None)])
def test_clip_search_is_the_plain_search_over_fake_quant(bits, group_size, symmetric):
    """The range search rounds every candidate in one buffer; it picks exactly what comparing
    each shrink's `fake_quant` (rtn's qparams, quantize and dequantize) by output error picks."""
    from quantpipe.quantize.awq import fake_quant, search_clip
    from quantpipe.quantize.stage import gptq_clip_shrinks

    g = torch.Generator().manual_seed(11)
    n, k = 96, 256
    w = torch.randn(n, k, generator=g) * torch.empty(n, k).exponential_(generator=g)
    w[:, :3] = 0  # all-zero groups' columns: the scale floor
    x = torch.randn(1024, k, generator=g) * torch.linspace(0.2, 4, k)
    h = 2 * x.t() @ x / len(x)
    scheme = WeightScheme(bits, group_size, symmetric)
    gs = group_size or k
    blocks = torch.stack([h[i:i + gs, i:i + gs] for i in range(0, k, gs)])
    best_err, want = None, None
    for r in gptq_clip_shrinks(bits):
        d = (w - fake_quant(w, scheme, r)).view(n, k // gs, gs)
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        if best_err is None:
            best_err, want = err, torch.full_like(err, r)
        else:
            want = torch.where(err < best_err, r, want)
            best_err = torch.minimum(err, best_err)
    got = search_clip(w, h, scheme, gptq_clip_shrinks(bits))
    assert torch.equal(got, want) and len(set(got.flatten().tolist())) > 2


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_per_channel_on_inputs_no_block_divides(act_order):
    """W8A16 per channel on the default model: K = 576 is no multiple of the 128-column block."""
    g = torch.Generator().manual_seed(5)
    k = 576
    w = torch.randn(32, k, generator=g)
    x = torch.randn(3072, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k))
    h = 2 * x[:2048].t() @ x[:2048] / 2048
    scheme = WeightScheme(8, None, True)
    q, scale, _, _ = gptq(w, h, scheme, block_size=128, act_order=act_order)
    assert q.shape == (32, k) and scale.shape == (32, 1)
    q_rtn, s_rtn, _ = rtn(w, scheme)

    def err(qq, ss):
        return ((x[2048:] @ w.t() - x[2048:] @ dequantize(qq, ss, None, scheme).t()) ** 2).mean().item()

    assert err(q, scale) < 0.7 * err(q_rtn, s_rtn), (err(q, scale), err(q_rtn, s_rtn))


def test_gptq_refuses_groups_that_straddle_blocks():
    with pytest.raises(ValueError, match="block_size 100 must be a multiple of group_size 64"):
        gptq(torch.randn(4, 128), torch.eye(128), WeightScheme(4, 64, True), block_size=100)


def test_gptq_retries_dampening_on_a_singular_hessian():
    h = torch.zeros(64, 64)
    h[0, 0] = 1.0  # rank one: dead columns are handled, the rest needs dampening
    h[1, 1] = -0.05  # not positive definite at 1% dampening (of the mean diagonal, ~0.97)
    q, scale, _, used = gptq(torch.randn(8, 64), h, WeightScheme(8, None, True), dampening=0.01)
    assert used > 0.01 and q.shape == (8, 64)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype, int8_kernel", [(torch.float32, "torch"), (torch.bfloat16, "torch"),
                                               (torch.bfloat16, "kernel")])
def test_int8pack_linear_is_one_function_on_both_sides_of_its_row_switch(dtype, int8_kernel, symmetric):
    """Up to INT8PACK_MAX_ROWS rows an int8 kernel runs (quantpipe's CPU kernel for bf16 where
    it is built, else torch's, which takes symmetric weights only: asymmetric ones go dense),
    past it the dense GEMM on the integer values less the zero point: all compute
    x @ dequantized.T (bf16 within its rounding)."""
    from quantpipe.runtime.model.cpu_kernels import CpuKernels
    from quantpipe.runtime.model.quantized import INT8PACK_MAX_ROWS, Int8PackLinear

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (96, 64), generator=g, dtype=torch.int8)
    # Zero points across their whole range: |q - z| reaches 255, the most bf16 holds exactly.
    zero = None if symmetric else torch.randint(-128, 128, (96, 1), generator=g).float()
    qw = QuantWeight(q, torch.rand(96, 1, generator=g) / 50 + 1e-3, zero, 8, None)
    lin = Int8PackLinear(qw, None, dtype, kernels=CpuKernels.parse("int8" if int8_kernel == "torch" else ""))
    if int8_kernel == "kernel":
        from quantpipe.runtime.model.quantized import int8_kernel as built

        if built() is None:
            pytest.skip("no C++ compiler or no AVX-512 here: torch's int8 kernel is the only one")
        assert lin.ext is built()
    else:
        assert lin.ext is None
    w = qw.dequantize(torch.float32)
    for rows in (1, 3, 5, INT8PACK_MAX_ROWS, INT8PACK_MAX_ROWS + 1, 128):
        x = torch.randn(2, rows, 64, generator=g)
        got = lin(x.to(dtype)).float()
        ref = x.to(dtype).float() @ w.t()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert got.shape == (2, rows, 96)
        assert torch.allclose(got, ref, atol=tol * ref.abs().max(), rtol=tol), (rows, (got - ref).abs().max())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n, k", [(96, 576), (13, 40), (7, 1536)])  # whole blocks; N and K tails
def test_cpu_int8_kernel_rounds_the_float32_product_once(n, k, symmetric):
    """quantpipe's int8 kernel sums in float32 and rounds to bf16 once, after the scale (and
    after taking z * sum(x) off for a zero point z): at most one bf16 step from the exactly
    rounded product (sums in another order), rarely."""
    from quantpipe.runtime.model.quantized import int8_kernel

    ext = int8_kernel()
    if ext is None:
        pytest.skip("no C++ compiler or no AVX-512 here")
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) / 50 + 1e-3).to(torch.bfloat16)
    zero = None if symmetric else torch.randint(-128, 128, (n,), generator=g).float()
    centered = w.double() if zero is None else w.double() - zero.double().unsqueeze(1)
    for rows in range(1, 10):
        x = (torch.randn(rows, k, generator=g) + 0.5).to(torch.bfloat16)  # sum(x) well away from 0
        got = ext.int8_linear_bf16(x, w, scale, zero)
        exact = (x.double() @ centered.t()) * scale.double()
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        step = exact.abs().float().clamp(min=1e-30) * 2.0**-7  # one bf16 step (upper bound)
        off = (got.float() - exact.bfloat16().float()).abs()
        assert (off <= step).all(), (rows, (off / step).max())
        assert (off > 0).float().mean() < 0.01, (rows, (off > 0).float().mean())
    with pytest.raises(RuntimeError, match="x has 3 columns"):
        ext.int8_linear_bf16(torch.zeros(1, 3, dtype=torch.bfloat16), w, scale)
    with pytest.raises(RuntimeError, match=f"zero: contiguous float32 of size {n}"):
        ext.int8_linear_bf16(torch.zeros(1, k, dtype=torch.bfloat16), w, scale, torch.zeros(n + 1))


@pytest.mark.parametrize("bits, group, symmetric", [(8, None, True), (8, 32, False), (4, 32, True), (4, 64, False),
                                                    (3, 64, True), (6, 32, False)])
def test_packed_linear_is_the_dequantized_product_on_each_of_its_paths(bits, group, symmetric):
    """A float32 model on CPU keeps W8/W4 weights packed (csrc/packed_linear.cpp), W3 in the
    4-bit layout and W6 in the 8-bit one: its decode (<= 16 rows), tiles (<= 512) and prefill
    paths all compute x @ dequantized.T, in float32."""
    from quantpipe.runtime.model.quantized import PackedLinear, container_bits, kernel_for, packed_kernel

    if packed_kernel() is None:
        pytest.skip("no C++ compiler here: float32 models dequantize")
    g = torch.Generator().manual_seed(0)
    n, k = 200, 576  # N not a multiple of the 4-row tiles, K several vector widths
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    groups = 1 if group is None else k // group
    zero = None if symmetric else torch.randint(lo // 2, hi // 2, (n, groups), generator=g).float()
    qw = QuantWeight(q, torch.rand(n, groups, generator=g) / 50 + 1e-3, zero, bits, group)
    assert kernel_for(qw, torch.device("cpu"), torch.float32) is PackedLinear
    bias = torch.randn(n, generator=g)
    lin = PackedLinear(qw, bias, torch.float32)
    assert lin.weight_packed.numel() == n * k * container_bits(bits) // 8  # held at its packed size
    w = qw.dequantize(torch.float32)
    for rows in (1, 2, 3, 16, 17, 100, 512, 513):
        x = torch.randn(rows, k, generator=g)
        ref = x @ w.t() + bias
        with torch.inference_mode():  # as the engine runs it (the kernel's threads too)
            got = lin(x)
        assert torch.equal(got, lin(x))
        assert got.shape == (rows, n)
        assert torch.allclose(got, ref, atol=1e-4 * ref.abs().max(), rtol=1e-4), (rows, (got - ref).abs().max())
    with pytest.raises(RuntimeError, match="x has 64 columns"):
        lin.ext.packed_linear_f32(torch.zeros(1, 64), lin.weight_packed, lin.bits, lin.scales, lin.zeros)
    odd = QuantWeight(torch.zeros(8, 40, dtype=torch.int8), torch.ones(8, 1), None, 8, None)
    assert kernel_for(odd, torch.device("cpu"), torch.float32).kernel == "dequant"  # K not a multiple of 32


@pytest.mark.parametrize("bits, group, symmetric, kernel", [(3, 64, True, "int4pack"), (2, 32, False, "int4pack"),
                                                            (6, None, True, "int8pack"), (6, 64, True, "packed-f32")])
def test_fewer_bits_take_the_next_wider_kernel_in_bf16_exactly(bits, group, symmetric, kernel):
    """W2/W3 run torch's int4 kernel and W6 per channel the int8 one, computing exactly what the
    same integers declared as W4 / W8 compute; W6 by group, which torch has no bf16 kernel
    for, runs the packed float32 kernel as W8 by group does."""
    from quantpipe.runtime.model.quantized import container_bits, kernel_for

    g = torch.Generator().manual_seed(bits)
    n, k = 64, 256
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    groups = 1 if group is None else k // group
    zero = None if symmetric else torch.randint(lo, hi, (n, groups), generator=g).float()
    scale = torch.rand(n, groups, generator=g) / 50 + 1e-3
    qw, wide = (QuantWeight(q, scale, zero, b, group) for b in (bits, container_bits(bits)))
    cpu = torch.device("cpu")
    cls = kernel_for(qw, cpu, torch.bfloat16)
    assert cls.kernel == kernel and cls is kernel_for(wide, cpu, torch.bfloat16)
    x = torch.randn(5, k, generator=g).bfloat16()
    with torch.inference_mode():
        got, same = cls(qw, None, torch.bfloat16)(x), cls(wide, None, torch.bfloat16)(x)
    assert torch.equal(got, same)
    ref = x.float() @ qw.dequantize(torch.float32).t()
    assert torch.allclose(got.float(), ref, atol=0.02 * ref.abs().max(), rtol=0.02)


def test_packed_kernel_off_leaves_its_layers_dequantized():
    from quantpipe.runtime.model.cpu_kernels import CpuKernels
    from quantpipe.runtime.model.quantized import kernel_for

    qw = QuantWeight(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1), None, 8, None)
    assert kernel_for(qw, torch.device("cpu"), torch.float32, CpuKernels.parse("packed")).kernel == "dequant"
    grouped = QuantWeight(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2), None, 8, 32)
    assert kernel_for(grouped, torch.device("cpu"), torch.bfloat16).kernel == "packed-f32"
    assert kernel_for(grouped, torch.device("cpu"), torch.bfloat16, CpuKernels.parse("packed")).kernel == "dequant"


def test_w8a8_linear_in_bf16_is_the_float32_function_within_bf16_rounding():
    """Served in bf16, W8A8 keeps its int8 weights for quantpipe's int8 kernel at decode-sized
    row counts and converts them for the bf16 GEMM past them; with that kernel turned off it
    holds them as bf16 values (exact) and takes the bf16 GEMM at every row count."""
    from quantpipe.runtime.model.cpu_kernels import CpuKernels
    from quantpipe.runtime.model.quantized import INT8PACK_MAX_ROWS, W8A8Linear, int8_kernel

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (96, 256), generator=g, dtype=torch.int8)
    qw = QuantWeight(q, torch.rand(96, 1, generator=g) / 50 + 1e-3, None, 8, None)
    exact = W8A8Linear(qw, None, torch.float32)
    kernel = W8A8Linear(qw, None, torch.bfloat16)
    plain = W8A8Linear(qw, None, torch.bfloat16, kernels=CpuKernels.parse("int8"))
    assert plain.weight_q.dtype == torch.bfloat16 and torch.equal(plain.weight_q.float(), q.float())
    if int8_kernel() is not None:  # built here: the weights stay int8
        assert kernel.weight_q.dtype == torch.int8 and torch.equal(kernel.weight_q, q)
    for rows in (1, 3, INT8PACK_MAX_ROWS, 64):
        x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        ref = exact(x.float())
        for fast in (kernel, plain):
            out = fast(x)
            got = out.float()
            assert out.dtype == torch.bfloat16
            # The same per-token integers either way; only the output's bf16 rounding differs.
            assert torch.allclose(got, ref, atol=1e-2 * ref.abs().max(), rtol=1e-2), (rows, (got - ref).abs().max())


def test_a_packed_zero_point_of_the_wrong_height_names_the_tensor():
    from quantpipe.formats.artifact import quantized_tensors, read_quantized

    q = torch.randint(-4, 4, (40, 64), dtype=torch.int8)
    qw = QuantWeight(q, torch.rand(40, 2) + 0.1, torch.randint(-4, 4, (40, 2)).float(), 3, 32)
    state = quantized_tensors("m", qw, "pack-quantized", torch.float32)
    assert state["m.weight_zero_point"].shape == (4, 2)  # 40 3-bit rows: 120 bits, 4 words
    qcfg = {"format": "pack-quantized", "config_groups": {"g": {"targets": ["re:^m$"], "weights": {
        "num_bits": 3, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}}
    back = read_quantized(dict(state), qcfg, "m")
    assert torch.equal(back.q, q) and torch.equal(back.zero, qw.zero)
    state["m.weight_zero_point"] = state["m.weight_zero_point"][:3]
    with pytest.raises(ValueError, match=r"m.weight_zero_point has shape \(3, 2\); expected int32 \[4, 2\] for "
                                         r"3-bit zero points of 40 rows"):
        read_quantized(state, qcfg, "m")
