"""Row-blocked float32 GEMMs: the same output as nn.Linear, the same parameters, CPU float32 only."""

import torch
from torch import nn

from quantpipe.runtime.model.blocked_linear import BLOCK_ROWS, MAX_ROWS, RowBlockedLinear, block_wide_linears


def _wide(bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 2 * BLOCK_ROWS + 100, bias=bias)  # a last block shorter than the others


def test_output_equals_linear_at_few_and_many_rows():
    for bias in (False, True):
        lin = _wide(bias)
        blocked = RowBlockedLinear(lin)
        for rows in (1, 16, MAX_ROWS, MAX_ROWS + 1):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(blocked(x), lin(x), rtol=1e-5, atol=1e-5)


def test_swap_keeps_parameters_and_skips_narrow_and_other_dtypes():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(2 * BLOCK_ROWS, 32)
            self.narrow = nn.Linear(32, BLOCK_ROWS)
            self.head = nn.Linear(32, 2 * BLOCK_ROWS, bias=False)
            self.head.weight = self.embed.weight  # tied, as lm_head often is

    toy = Toy()
    keys = set(toy.state_dict())
    assert block_wide_linears(toy, torch.device("cpu")) == ["head"]
    assert isinstance(toy.head, RowBlockedLinear) and type(toy.narrow) is nn.Linear
    assert toy.head.weight is toy.embed.weight
    assert set(toy.state_dict()) == keys

    assert block_wide_linears(Toy().to(torch.bfloat16), torch.device("cpu")) == []
    assert block_wide_linears(Toy(), torch.device("meta")) == []


def test_engine_on_cpu_float32_blocks_lm_head_and_gate_up():
    from quantpipe.runtime import LLM

    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=256)
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, RowBlockedLinear)
    assert all(isinstance(layer.mlp.gate_up_proj, RowBlockedLinear) for layer in model.layers)
    assert type(model.layers[0].self_attn.qkv_proj) is nn.Linear  # 960 outputs: not wide
