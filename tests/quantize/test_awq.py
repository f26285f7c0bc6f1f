"""AWQ: scale folding leaves the unquantized model's function unchanged, the searches lower
the activation-weighted error below RTN's, and AWQ artifacts load and beat RTN."""

from __future__ import annotations

import pytest
import torch

from quantpipe.quantize import QuantConfig, awq, quantize
from quantpipe.quantize.rtn import WeightScheme
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model
from tests.model.test_parity_architectures import build

IDS = [3, 17, 250, 99, 4, 4, 120, 300, 7, 64, 12, 200, 31, 9, 150, 42]


def build_mha(tmp_path):
    """A random Llama whose every query head has its own KV head (so v -> o scaling applies)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                                   initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path / "mha"
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(path)
    return str(path)


def _gates(model, cfg) -> list[torch.Tensor]:
    """The weights of every MoE layer's router and shared-expert gate."""
    mlps = [model.layers[i].mlp for i in cfg.moe_layers]
    return [g.weight for m in mlps for g in (m.gate, m.shared_expert_gate) if g is not None]


@pytest.mark.parametrize("arch", ["llama-gqa-untied-llama3-rope", "qwen2-bias", "mha", "qwen3-moe", "mixtral",
                                  "qwen2-moe"])
def test_folding_scales_leaves_the_function_unchanged(tmp_path, arch):
    """In a MoE layer the experts' gate/up share one scale, which the router (and a shared
    expert's gate) takes too, and each expert's down projection has its own."""
    src = build_mha(tmp_path) if arch == "mha" else build(tmp_path, arch)[1]
    model, cfg, _ = load_model(src, torch.float32)
    ref = sequence_logits(model, IDS)
    routers = [w.clone() for w in _gates(model, cfg)]
    g = torch.Generator().manual_seed(1)

    def scales(n):
        return torch.exp(torch.randn(n, generator=g))  # spread over about e^-2 .. e^2

    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        moe = i in cfg.moe_layers
        shared = [scales(cfg.shared_expert_intermediate_size)] if cfg.shared_expert_intermediate_size else []
        s_down = [scales(cfg.moe_intermediate_size) for _ in range(cfg.num_experts)] + shared if moe \
            else scales(cfg.intermediate_size)
        awq.fold_scales(layer, s_qkv=scales(cfg.hidden_size), s_gate_up=scales(cfg.hidden_size), s_down=s_down,
                        s_o=scales(attn.q_size) if attn.num_heads == attn.num_kv_heads else None)
    got = sequence_logits(model, IDS)
    assert not torch.equal(model.layers[0].input_layernorm.weight, torch.ones(cfg.hidden_size))
    assert all(not torch.equal(w, r) for w, r in zip(_gates(model, cfg), routers, strict=True))
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


def test_searches_lower_the_activation_weighted_error():
    g = torch.Generator().manual_seed(0)
    k, n = 256, 128
    x = torch.randn(4096, k, generator=g)
    x[:, :8] *= 25  # a few input channels carry large activations, as in real LLMs
    w = torch.randn(n, k, generator=g) / k ** 0.5
    h = x.t() @ x / len(x)
    scheme = WeightScheme(4, 64, True)
    rtn_err = awq.output_error(w, awq.fake_quant(w, scheme), h).sum().item()
    s, alpha, ratio = awq.search_scale([w], [h], [scheme])
    assert alpha > 0 and ratio < 0.9
    scaled_err = awq.output_error(w, awq.fake_quant(w * s, scheme) / s, h).sum().item()
    assert scaled_err == pytest.approx(ratio * rtn_err, rel=1e-4)
    hs = h / (s[:, None] * s[None, :])
    q, scale, zero = awq.quantize_clipped(w * s, hs, scheme, torch.float32)
    w_hat = (q.float().view(n, -1, 64) * scale.unsqueeze(-1)).view(n, k) / s
    clipped_err = awq.output_error(w, w_hat, h).sum().item()
    assert clipped_err <= scaled_err * 1.0001 and clipped_err < 0.8 * rtn_err
    # held-out inputs from the same distribution see the same gain
    x2 = torch.randn(2048, k, generator=g)
    x2[:, :8] *= 25
    err = lambda wh: ((x2 @ (w - wh).t()) ** 2).mean()  # noqa: E731
    assert err(w_hat) < 0.8 * err(awq.fake_quant(w, scheme))
    shrink = awq.search_clip(w, h, scheme)
    assert shrink.shape == (n, k // 64)
    assert all(min(abs(u - r) for r in awq.SHRINKS) < 1e-6 for u in shrink.unique().tolist())
    assert shrink.min() < 1  # some groups are clipped


def test_awq_artifact_loads_and_beats_rtn(tmp_path):
    src = build_mha(tmp_path)
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 320, (64,), generator=g).tolist() for _ in range(16)]
    held = [torch.randint(0, 320, (64,), generator=g).tolist() for _ in range(4)]
    ref, _, _ = load_model(src, torch.float32)
    kl = {}
    for method in ("rtn", "awq"):
        art = quantize(src, QuantConfig(scheme="W4A16", group_size=32, method=method), None,
                       str(tmp_path / method), calib_token_ids=calib)
        model, _, _ = load_model(str(tmp_path / method), torch.float32)
        total = 0.0
        for ids in held:
            a, b = sequence_logits(ref, ids).log_softmax(-1), sequence_logits(model, ids).log_softmax(-1)
            total += (a.exp() * (a - b)).sum(-1).mean().item() / len(held)
        kl[method] = total
    searched = art.manifest["layers"]["model.layers.0.self_attn.o_proj"]["awq"]
    assert 0 <= searched["alpha"] < 1 and searched["error_ratio"] <= 1
    assert art.manifest["calibration"]["kind"] == "token_ids" and art.manifest["method"] == "awq"
    assert kl["awq"] < 0.95 * kl["rtn"], kl


def test_awq_bad_input_is_refused(tmp_path):
    from quantpipe.manifest import StageError

    with pytest.raises(StageError, match="method awq is for weight-only schemes"):
        QuantConfig(scheme="W8A8", method="awq")
    _, src = build(tmp_path, "llama-tied")
    with pytest.raises(StageError, match="AWQ needs at least 256"):
        quantize(src, QuantConfig(scheme="W4A16", group_size=32, method="awq"), None, str(tmp_path / "a"),
                 calib_token_ids=[[1, 2, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(StageError, match="--calib: AWQ needs calibration data"):
        quantize(src, QuantConfig(scheme="W4A16", group_size=32, method="awq"), None, str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
