"""Mixed precision's sensitivity: rerunning only the layers after the quantized one gives
exactly the KL of a whole forward pass with that one layer quantized."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantpipe.quantize import mixed
from quantpipe.quantize.rtn import WeightScheme, dequantize, rtn
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model
from tests.model.test_parity_architectures import build


def test_sensitivity_equals_a_whole_forward_pass_per_layer(tmp_path):
    _, src = build(tmp_path, "llama-gqa-untied-llama3-rope")
    model, _, _ = load_model(src, torch.float32)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 320, (40,), generator=g).tolist() for _ in range(3)]
    names = ["layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj", "lm_head"]
    schemes = [WeightScheme(8, None, True), WeightScheme(4, 32, True)]
    got = mixed.sensitivities(model, names, schemes, samples)
    for name in names:
        mod = model.get_submodule(name)
        original = mod.weight.detach().clone()
        for sch in schemes:
            q, scale, zero = rtn(original, sch)
            with torch.no_grad():
                mod.weight.copy_(dequantize(q, scale, zero, sch))
            kl = 0.0
            for ids in samples:
                ref = F.log_softmax(sequence_logits(model, ids).double(), -1)
                with torch.no_grad():
                    mod.weight.copy_(original)
                base = F.log_softmax(sequence_logits(model, ids).double(), -1)
                with torch.no_grad():
                    mod.weight.copy_(dequantize(q, scale, zero, sch))
                kl += float((base.exp() * (base - ref)).sum(-1).mean()) / len(samples)
            with torch.no_grad():
                mod.weight.copy_(original)
            assert abs(got[name][sch.describe()] - kl) <= 1e-9 + 1e-6 * kl, (name, sch, got[name], kl)
        assert got[name]["W4 g32 sym"] > got[name]["W8 channel sym"] > 0


@pytest.mark.parametrize("name", ["sensitivity_samples", "sensitivity_tokens"])
def test_sensitivity_sizes_must_be_positive(name):
    from quantpipe.manifest import StageError
    from quantpipe.quantize import QuantConfig

    with pytest.raises(StageError, match=f"{name} must be at least 1, got 0"):
        QuantConfig(scheme="mixed", bits_budget=5, **{name: 0})
