"""Architecture description shared by both loaders, with the fields we refuse."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
GEMMA3 = "Gemma3ForCausalLM"
MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
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
    rope_scaling: dict | None = None  # llama3, yarn, or linear (Gemma 3's global layers)
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
    # Mixture of experts: the layers in moe_layers replace their MLP by num_experts experts of
    # moe_intermediate_size, num_experts_per_tok of them per token, picked by a router.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the picked experts' router probabilities renormalized to sum to 1
    moe_layers: tuple[int, ...] = ()
    # Qwen2-MoE: beside the routed experts, one shared expert that every token goes through,
    # its output weighted by sigmoid(shared_expert_gate(x)). 0: none.
    shared_expert_intermediate_size: int = 0

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
        if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            _refuse(cfg, "sliding_window", lambda v: v is not None, "sliding-window attention is not supported")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            _refuse(cfg, "use_sliding_window", lambda v: bool(v), "sliding-window attention is not supported")
        # transformers >= 5 writes rope_parameters; older configs rope_theta + rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        rope_scaling = _rope_scaling(cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") else None),
                                     ("llama3", "yarn"))
        if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
            rope_scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
            if rope_scaling.get("factor") is None:
                rope_scaling["factor"] = cfg.get("max_position_embeddings", 2048) / rope_scaling[
                    "original_max_position_embeddings"]
        return cls(
            **_common(cfg, arch),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=(arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
                            or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            **(_moe(cfg, arch) if arch in MOE else {}),
        )


def _moe(cfg: dict, arch: str) -> dict:
    n = cfg["num_hidden_layers"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"config field num_experts={experts!r} must be a positive integer")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"config field num_experts_per_tok={top_k!r} must be an integer in [1, {experts}]")
    if arch == "MixtralForCausalLM":  # every layer sparse; experts as wide as the dense MLP; always renormalized
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=cfg["intermediate_size"],
                    norm_topk_prob=True, moe_layers=tuple(range(n)))
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if arch == "Qwen3MoeForCausalLM":
        _refuse(cfg, "shared_expert_intermediate_size", bool, "Qwen3-MoE has no shared expert (Qwen2-MoE has)")
    elif not isinstance(shared, int) or shared < 0:
        raise ValueError(f"config field shared_expert_intermediate_size={shared!r} must be a non-negative integer")
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config field decoder_sparse_step={step!r} must be a positive integer")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), shared_expert_intermediate_size=shared,
                moe_layers=tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0))


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


def fused_linears(cfg: ModelConfig, layer: int) -> list[tuple[str, tuple[str, ...]]]:
    """Layer `layer`'s quantizable Linears: (our fused module's local name, the local names of
    the checkpoint's modules it fuses). A mixture-of-experts layer lists each expert's; its
    router (and a shared expert's gate) stays in high precision and is not listed."""
    out = [("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
           ("self_attn.o_proj", ("self_attn.o_proj",))]
    mlps = ["mlp."]
    if layer in cfg.moe_layers:
        mlps = [f"mlp.experts.{e}." for e in range(cfg.num_experts)]
        mlps += ["mlp.shared_expert."] if cfg.shared_expert_intermediate_size else []
    for m in mlps:
        out += [(m + "gate_up_proj", (m + "gate_proj", m + "up_proj")), (m + "down_proj", (m + "down_proj",))]
    return out


def routers(cfg: ModelConfig) -> list[str]:
    """The Linears that pick or weigh experts: kept in high precision (an artifact's `ignore`)."""
    gates = ["mlp.gate"] + (["mlp.shared_expert_gate"] if cfg.shared_expert_intermediate_size else [])
    return [f"layers.{i}.{g}" for i in cfg.moe_layers for g in gates]


_MIXTRAL_TO_OURS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OURS_TO_MIXTRAL = {v: k for k, v in _MIXTRAL_TO_OURS.items()}


def checkpoint_name(cfg: ModelConfig, name: str) -> str:
    """Our unfused module or tensor name as the architecture's checkpoints spell it: Mixtral
    calls the MoE block block_sparse_moe and its experts' Linears w1 (gate), w3 (up), w2 (down)."""
    if cfg.architecture != "MixtralForCausalLM":
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    return re.sub(r"(\.experts\.\d+)\.(gate_proj|up_proj|down_proj)\b", lambda m: f"{m[1]}.{_OURS_TO_MIXTRAL[m[2]]}", name)


def our_name(cfg: ModelConfig, name: str) -> str:
    """The inverse of checkpoint_name."""
    if cfg.architecture != "MixtralForCausalLM":
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+)\.(w[123])\b", lambda m: f"{m[1]}.{_MIXTRAL_TO_OURS[m[2]]}", name)


def _refuse(cfg: dict, field: str, is_bad, why: str) -> None:
    if field in cfg and is_bad(cfg[field]):
        raise ValueError(f"config field {field}={cfg[field]!r} is not supported: {why}")
