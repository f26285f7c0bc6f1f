"""Architecture description shared by both loaders, with the fields we refuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")
GEMMA3 = "Gemma3ForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types values


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3, or linear (Gemma 3's global layers)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3: local layers attend to the last `sliding_window` positions with their own rope
    # base; the others are global. Empty layer_types: every layer global.
    hidden_act: str = "silu"  # or gelu_pytorch_tanh (Gemma)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: int | float | None = None  # scores scaled by its -1/2 power; None: head_dim's

    @property
    def is_gemma3(self) -> bool:
        return self.architecture == GEMMA3

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch == GEMMA3:
            return _gemma3(cfg)
        _refuse(cfg, "hidden_act", lambda v: v not in (None, "silu"), "only silu is supported")
        _refuse(cfg, "mlp_bias", lambda v: bool(v), "MLP bias is not supported")
        _refuse(cfg, "pretraining_tp", lambda v: v not in (None, 1), "only 1 is supported")
        if arch == "MistralForCausalLM":
            _refuse(cfg, "sliding_window", lambda v: v is not None, "sliding-window attention is not supported")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            _refuse(cfg, "use_sliding_window", lambda v: bool(v), "sliding-window attention is not supported")
        # transformers >= 5 writes rope_parameters; older configs rope_theta + rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        rope_scaling = _rope_scaling(cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") else None),
                                     ("llama3",))
        return cls(
            **_common(cfg, arch),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )


def _common(cfg: dict, arch: str) -> dict:
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _rope_scaling(scaling: dict | None, allowed: tuple[str, ...], key: str = "rope_scaling") -> dict | None:
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in allowed:
        raise ValueError(f"config field {key} of type {kind!r} is not supported (only "
                         f"{', '.join(repr(a) for a in allowed)})")
    return {**scaling, "rope_type": kind}


def _gemma3(cfg: dict) -> ModelConfig:
    """Gemma3ForCausalLM (model_type gemma3_text), in transformers 5's and 4's spellings."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config field hidden_activation={act!r} is not supported: only gelu_pytorch_tanh")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        _refuse(cfg, field, lambda v: v is not None, "logit soft-capping is not supported (Gemma 3 has none)")
    _refuse(cfg, "use_bidirectional_attention", lambda v: bool(v), "only causal attention is supported")
    _refuse(cfg, "attention_bias", lambda v: bool(v), "Gemma 3 has no attention bias")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # transformers 4: every sliding_window_pattern-th layer is global
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"config field layer_types must list {n} of {SLIDING!r} / {FULL!r}, got {types!r}")
    params = cfg.get("rope_parameters") or {}
    full = params.get(FULL) or {}
    local = params.get(SLIDING) or {}
    theta = float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
    scaling = _rope_scaling(full if full.get("rope_type") else cfg.get("rope_scaling"), ("linear",))
    _rope_scaling(local if local.get("rope_type") else None, (), "rope_parameters.sliding_attention")
    window = cfg.get("sliding_window")
    if SLIDING in types and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"config field sliding_window={window!r} must be a positive integer (layer_types has "
                         f"{SLIDING!r} layers)")
    return ModelConfig(
        **_common(cfg, GEMMA3),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        layer_types=tuple(types),
        sliding_window=window if SLIDING in types else None,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
    )


def _refuse(cfg: dict, field: str, is_bad, why: str) -> None:
    if field in cfg and is_bad(cfg[field]):
        raise ValueError(f"config field {field}={cfg[field]!r} is not supported: {why}")
