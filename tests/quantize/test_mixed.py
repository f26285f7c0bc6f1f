"""Mixed precision's sensitivity: rerunning only the layers after the quantized one gives
exactly the KL of a whole forward pass with that one layer quantized (float32 passes, held
to a float64 log-softmax); the table is reused across budgets only when measured alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantpipe.manifest import StageError
from quantpipe.quantize import QuantConfig, mixed, quantize
from quantpipe.quantize.rtn import WeightScheme, dequantize, rtn
from quantpipe.runtime.model.divergence import kl_rows
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
    # The layers after the quantized one run for every precision and sample at once: the
    # same numbers as one sequence per call, to the last bit.
    assert mixed.sensitivities(model, names, schemes, samples, max_rows=1) == got
    for name in names:
        mod = model.get_submodule(name)
        original = mod.weight.detach().clone()
        for sch in schemes:
            q, scale, zero = rtn(original, sch)
            with torch.no_grad():
                mod.weight.copy_(dequantize(q, scale, zero, sch))
            kl, kl64 = 0.0, 0.0
            for ids in samples:
                cand = sequence_logits(model, ids)
                with torch.no_grad():
                    mod.weight.copy_(original)
                base = sequence_logits(model, ids)
                with torch.no_grad():
                    mod.weight.copy_(dequantize(q, scale, zero, sch))
                kl += float(kl_rows(base, cand).mean()) / len(samples)
                lb, lc = F.log_softmax(base.double(), -1), F.log_softmax(cand.double(), -1)
                kl64 += float((lb.exp() * (lb - lc)).sum(-1).mean()) / len(samples)
            with torch.no_grad():
                mod.weight.copy_(original)
            assert abs(got[name][sch.describe()] - kl) <= 1e-12 + 1e-9 * kl, (name, sch, got[name], kl)
            # The scorer's bound for float32 passes: 1e-7 per token plus 1e-6 of the KL.
            assert abs(kl - kl64) <= 1e-7 + 1e-6 * kl64, (name, sch, kl, kl64)
        assert got[name]["W4 g32 sym"] > got[name]["W8 channel sym"] > 0


@pytest.mark.parametrize("name", ["sensitivity_samples", "sensitivity_tokens"])
def test_sensitivity_sizes_must_be_positive(name):
    with pytest.raises(StageError, match=f"{name} must be at least 1, got 0"):
        QuantConfig(scheme="mixed", bits_budget=5, **{name: 0})


def test_a_table_measured_alike_is_reused_across_budgets_and_gives_the_same_artifact(tmp_path, caplog):
    """The 6-bit rung reuses the 5-bit rung's table: its bytes equal a 6-bit run that measured
    its own. Another probe (more sensitivity tokens) or another model is measured again."""
    _, src = build(tmp_path, "llama-gqa-untied-llama3-rope")
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 320, (32,), generator=g).tolist() for _ in range(4)]

    def run(name, budget, earlier=None, **kw):
        cfg = QuantConfig(scheme="mixed", bits_budget=budget, group_size=32, dtype="float32", **kw)
        return quantize(src, cfg, None, str(tmp_path / name), calib_token_ids=ids, sensitivity_from=earlier)

    five = run("five", 5.0)
    assert five.manifest["mixed_precision"]["reused_from"] is None
    reused = run("six-reused", 6.0, earlier=str(tmp_path / "five"))
    measured = run("six", 6.0)
    mp = reused.manifest["mixed_precision"]
    assert mp["reused_from"] == {"artifact": "five", "artifact_sha256": five.manifest["artifact_sha256"]}
    assert mp["table"] == measured.manifest["mixed_precision"]["table"] == five.manifest["mixed_precision"]["table"]
    assert mp["chosen"] != five.manifest["mixed_precision"]["chosen"]  # the budget still decides
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "six-reused" / f).read_bytes() == (tmp_path / "six" / f).read_bytes(), f

    # Fewer precisions read their entries out of the larger table; more are measured again.
    fewer = run("five-w4", 5.0, earlier=str(tmp_path / "five"), mixed_bits=[4]).manifest["mixed_precision"]
    assert fewer["reused_from"] is not None
    assert fewer["table"] == {n: {"W4 g32 sym": v["W4 g32 sym"]} for n, v in mp["table"].items()}
    assert fewer["measured_on"]["schemes"] == ["W4 g32 sym"]
    with caplog.at_level("INFO", logger="quantpipe.quantize"):
        more = run("five-w3", 5.0, earlier=str(tmp_path / "five"), mixed_bits=[3, 4, 8])
    assert more.manifest["mixed_precision"]["reused_from"] is None
    assert "is not reusable: it did not measure W3 g32 sym" in caplog.text
    with caplog.at_level("INFO", logger="quantpipe.quantize"):
        other = run("six-longer", 6.0, earlier=str(tmp_path / "five"), sensitivity_tokens=16)
    assert other.manifest["mixed_precision"]["reused_from"] is None
    assert "is not reusable: it was measured differently (probe_sha256 differ)" in caplog.text
    table, why = mixed.reusable(five.manifest["mixed_precision"],
                                dict(five.manifest["mixed_precision"]["measured_on"], source_sha256="0" * 64),
                                dict.fromkeys(five.manifest["mixed_precision"]["table"], 64),
                                QuantConfig(scheme="mixed", bits_budget=5, group_size=32).mixed_candidates())
    assert table is None and why == "it was measured differently (source_sha256 differ)"

    with pytest.raises(StageError, match="--sensitivity-from .*: not a quantpipe artifact"):
        run("bad", 6.0, earlier=str(tmp_path))
    with pytest.raises(StageError, match="--sensitivity-from applies to --scheme mixed only"):
        quantize(src, QuantConfig(scheme="W8A16"), None, str(tmp_path / "w8"), sensitivity_from=str(tmp_path / "five"))
    assert not (tmp_path / "bad").exists() and not (tmp_path / "w8").exists()


def test_assignment_is_the_best_within_the_budget_and_fits_at_the_cheapest_average():
    """Against every assignment of 6 layers (4 precisions, one of them not dividing 2 layers):
    the knapsack's never exceeds the budget, and its summed sensitivity is the least among
    those that fit with a margin of one unit per layer (what rounding costs may leave unspent).
    A budget equal to the cheapest assignment's average fits: all at their cheapest."""
    import itertools

    cands = [None, WeightScheme(8, None, True), WeightScheme(4, 128, True), WeightScheme(3, 64, True)]
    g = torch.Generator().manual_seed(7)
    params = {f"l{i}": int(p) for i, p in enumerate(torch.randint(1000, 5000, (6,), generator=g))}
    inf = {n: 192 if i < 2 else 256 for i, n in enumerate(params)}  # 128 does not divide 192
    sens = {n: {c.describe(): float(torch.rand((), generator=g)) * c.num_bits ** -2 for c in cands[1:]
                if mixed.applies(c, inf[n])} for n in params}
    total = sum(params.values())

    def cost(a):
        return sum(mixed.bits_of(s, inf[n]) * params[n] for n, s in zip(params, a)) / total

    def loss(a):
        return sum(0.0 if s is None else sens[n][s.describe()] for n, s in zip(params, a))

    every = [a for a in itertools.product(cands, repeat=6) if all(mixed.applies(s, inf[n]) for n, s in zip(params, a))]
    cheapest = min(map(cost, every))
    for budget in (cheapest, 4.0, 5.0, 7.5, 12.0):
        got = mixed.assign(params, inf, sens, cands, budget, resolution=2000)
        a = [got[n] for n in params]
        assert cost(a) <= budget + 1e-12
        margin = 6 * (budget - cheapest) / 2000
        assert loss(a) <= min(loss(b) for b in every if cost(b) <= budget - margin) + 1e-12, budget
    assert all(s is not None and s.num_bits in (3, 4) for s in mixed.assign(params, inf, sens, cands, cheapest).values())
    with pytest.raises(ValueError, match=r"no assignment fits 3.0 bits per weight \(the cheapest takes 3.25\)"):
        mixed.assign(params, inf, sens, cands, 3.0)


def test_a_table_with_nan_is_refused_not_read_as_bf16():
    cands = [None, WeightScheme(4, 64, True)]
    sens = {"a": {"W4 g64 sym": float("nan")}, "b": {"W4 g64 sym": 0.1}}
    for budget in (4.25, 16):  # none fits / bf16 fits: refused either way, never a silent bf16
        with pytest.raises(ValueError, match=r"NaN or infinite entries \(a W4 g64 sym\)"):
            mixed.assign({"a": 100, "b": 100}, {"a": 64, "b": 64}, sens, cands, budget)
