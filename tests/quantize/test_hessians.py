"""The Hessians GPTQ and AWQ calibrate on: H = 2 X^T X / n of each Linear's inputs over every
calibration token, against the same product taken here from hooks on full layer passes
(`_layer_hessians` sums only the strips on and above the diagonal and stops each pass after
the layer's last Linear has its input)."""

from __future__ import annotations

import pytest
import torch

from quantpipe.quantize import stage
from quantpipe.runtime.model.config import fused_linears
from quantpipe.runtime.model.forward import SequencePass
from quantpipe.runtime.model.loader import load_model
from tests.model.test_parity_architectures import build
from tests.quantize.test_moe import token_ids


@pytest.mark.parametrize("arch", ["llama-tied", "qwen3-moe"])
def test_each_linears_hessian_is_the_gram_of_its_inputs(tmp_path, monkeypatch, arch):
    # Strips of 24 columns: the small model's 64 and 128 inputs split into several, one partial.
    monkeypatch.setattr(stage, "GRAM_BLOCK", 24)
    _, src = build(tmp_path, arch)
    model, _, _ = load_model(src, torch.float32)
    passes = [SequencePass(model, ids) for ids in token_ids(4, 24, seed=1)]
    with torch.inference_mode():
        xs = [p.embed() for p in passes]
    for i, layer in enumerate(model.layers):
        mods = {n: layer.get_submodule(n) for n, _ in fused_linears(model.config, i)}
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in mods}

        def keep(name):
            return lambda module, inputs, output: seen[name].append(inputs[0].reshape(-1, inputs[0].shape[-1]))

        handles = [m.register_forward_hook(keep(n)) for n, m in mods.items()]
        with torch.inference_mode():
            outs = [p.layer(i, x) for p, x in zip(passes, xs)]
        for h in handles:
            h.remove()
        hs, routed = stage._layer_hessians(i, mods, passes, xs, layer)
        for name in mods:
            x = torch.cat(seen[name]).double() if seen[name] else torch.zeros(0, mods[name].in_features)
            assert routed[name] == len(x), name
            want = (2 * x.t() @ x / max(len(x), 1)).float()
            torch.testing.assert_close(hs[name], want, rtol=1e-6, atol=1e-6 * float(want.abs().max()) + 1e-12)
            assert torch.equal(hs[name], hs[name].t()), name
        xs = outs
