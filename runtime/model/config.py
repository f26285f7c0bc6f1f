"""Architecture description shared by both loaders, with the fields we refuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
    rope_scaling: dict | None = None  # llama3 only
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
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
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") else None)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind == "default":
                rope_scaling = None
            elif kind != "llama3":
                raise ValueError(f"config field rope_scaling of type {kind!r} is not supported (only 'llama3')")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
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
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _refuse(cfg: dict, field: str, is_bad, why: str) -> None:
    if field in cfg and is_bad(cfg[field]):
        raise ValueError(f"config field {field}={cfg[field]!r} is not supported: {why}")
