"""bf16 Linear layers prepacked for oneDNN: bit-identical outputs, the weight still readable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantpipe.runtime.model.prepacked_linear import PrepackedLinear, _cpu_has_avx512_bf16, prepack_linears

needs_bf16_cpu = pytest.mark.skipif(not (_cpu_has_avx512_bf16() and torch.backends.mkldnn.is_available()),
                                    reason="packing is used only on CPUs with AVX-512 BF16")


@needs_bf16_cpu
@pytest.mark.parametrize("bias", [False, True])
def test_outputs_equal_f_linear_at_every_row_count(bias):
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=bias).bfloat16()
    packed = PrepackedLinear(lin)
    for rows in (1, 5, 16, 64, 300):
        x = torch.randn(rows, 576).bfloat16()
        assert torch.equal(packed(x), lin(x)), rows
    x3 = torch.randn(2, 7, 576).bfloat16()
    assert torch.equal(packed(x3), lin(x3))
    assert torch.equal(packed.weight, lin.weight)
    assert set(packed.state_dict()) == set(lin.state_dict())
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in lin.state_dict().items())


@needs_bf16_cpu
def test_the_engine_packs_bf16_layers_and_generates_as_before():
    from quantpipe.runtime import LLM, SamplingParams
    from quantpipe.runtime.model.export import hf_state_dict

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "A list in Python"]
    plain = LLM(dtype="bfloat16", device="cpu", max_num_seqs=4, kv_cache_memory="64MiB",
                disable_cpu_kernels="prepack")
    packed = LLM(dtype="bfloat16", device="cpu", max_num_seqs=4, kv_cache_memory="64MiB")
    model = packed.engine.runner.model
    assert isinstance(model.lm_head, PrepackedLinear)
    assert all(isinstance(layer.mlp.down_proj, PrepackedLinear) for layer in model.layers)
    assert type(plain.engine.runner.model.lm_head) is nn.Linear
    # Same batch, same dtype: the packed GEMMs give the same bits, so the same tokens.
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == want
    exported, reference = hf_state_dict(model), hf_state_dict(plain.engine.runner.model)
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)


def test_nothing_is_packed_off_cpu_or_in_float32():
    toy = nn.Sequential(nn.Linear(8, 8).bfloat16())
    assert prepack_linears(toy, torch.device("meta")) == []
    assert type(toy[0]) is nn.Linear
    toy32 = nn.Sequential(nn.Linear(8, 8))
    assert prepack_linears(toy32, torch.device("cpu")) == []  # float32 layers are left alone
