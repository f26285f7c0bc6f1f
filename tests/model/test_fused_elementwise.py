"""The fused bf16 RMSNorm and SiLU-mul: the torch composition's values, within a bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantpipe.runtime.model.cpu_attention import extension
from quantpipe.runtime.model.fused_elementwise import FusedMLP, FusedRMSNorm
from quantpipe.runtime.model.llama import MLP, RMSNorm

ext = extension()
needs_ext = pytest.mark.skipif(ext is None, reason="no C++ compiler for the CPU kernels")


def _within_one_rounding(got: torch.Tensor, want: torch.Tensor, steps: int = 1, min_equal: float = 0.999) -> None:
    """Nearly every value equal; the rest `steps` bf16 steps apart at most (float32 sums in
    another order, or a vector exp, landing on the other side of a rounding boundary)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    same = (got == want).float().mean().item()
    assert same > min_equal, same
    step = want.float().abs().clamp(min=1e-30) * 2.0 ** -7 * steps  # one bf16 ulp or more, each
    bad = ((got.float() - want.float()).abs() > step + 1e-30).nonzero()
    assert len(bad) == 0, [(tuple(i), got[tuple(i)].item(), want[tuple(i)].item()) for i in bad[:5].tolist()]


@needs_ext
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_rms_norm_matches_the_composition(rows):
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5).bfloat16()
    norm.weight.data = (torch.rand(576) + 0.5).bfloat16()
    x = (torch.randn(rows, 576) * 3).bfloat16()
    _within_one_rounding(ext.rms_norm_bf16(x, norm.weight, 1e-5), norm(x))
    wide = (torch.randn(rows, 1152) * 3).bfloat16()[:, 288:864]  # strided rows
    _within_one_rounding(ext.rms_norm_bf16(wide, norm.weight, 1e-5), norm(wide))


@needs_ext
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_silu_mul_matches_the_composition(rows):
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 3072) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])  # past exp's float32 range, and zero
    gate, up = gate_up.chunk(2, dim=-1)
    # SiLU's value rounds to bf16 before the product, so a one-step difference there comes
    # out scaled by `up`: two steps of the product at most. The vector exp differs from
    # torch's in the last float32 bits, which moves about 0.1% of the SiLU values one step.
    _within_one_rounding(ext.silu_mul_bf16(gate_up), F.silu(gate) * up, steps=2, min_equal=0.995)


@needs_ext
def test_bad_tensors_are_refused_by_name():
    with pytest.raises(RuntimeError, match="rms_norm_bf16 x: a bf16 CPU tensor"):
        ext.rms_norm_bf16(torch.randn(2, 8), torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be contiguous bf16 of size 8"):
        ext.rms_norm_bf16(torch.randn(2, 8).bfloat16(), torch.ones(4).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="odd width 7"):
        ext.silu_mul_bf16(torch.randn(2, 7).bfloat16())


@needs_ext
def test_the_engine_fuses_bf16_models_only_and_stays_close():
    from quantpipe.runtime import LLM

    llm = LLM(dtype="bfloat16", device="cpu", max_num_seqs=4, kv_cache_memory="64MiB")
    model = llm.engine.runner.model
    assert all(type(layer.mlp) is FusedMLP and type(layer.input_layernorm) is FusedRMSNorm for layer in model.layers)
    assert type(model.norm) is FusedRMSNorm
    ids = torch.tensor(llm.get_tokenizer().encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number."))
    with torch.inference_mode():
        fused = _hidden(model, ids)
        for m in model.modules():  # back to the torch composition, same weights
            if type(m) is FusedRMSNorm:
                m.__class__ = RMSNorm
            elif type(m) is FusedMLP:
                m.__class__ = MLP
        plain = _hidden(model, ids)
    rel = ((fused.float() - plain.float()).norm() / plain.float().norm()).item()
    assert rel < 0.02, rel  # bf16 noise, not a different function
    llm32 = LLM(dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory="64MiB")
    assert not any(type(m) in (FusedMLP, FusedRMSNorm) for m in llm32.engine.runner.model.modules())
    off = LLM(dtype="bfloat16", device="cpu", max_num_seqs=4, kv_cache_memory="64MiB",
              disable_cpu_kernels="fused-elementwise")
    assert not any(type(m) in (FusedMLP, FusedRMSNorm) for m in off.engine.runner.model.modules())


def _hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The last layer's output through every RMSNorm and MLP (attention left out: it needs a cache)."""
    x = model.embed_tokens(ids)
    for layer in model.layers:
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)
