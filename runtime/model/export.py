"""Write a loaded model as an HF folder (config.json, model.safetensors, tokenizer files),
so a GGUF can be served or compared by tools that only read HF folders."""

from __future__ import annotations

import json
import os

import torch

from quantpipe.runtime.model.config import ModelConfig, checkpoint_name
from quantpipe.runtime.model.llama import LlamaForCausalLM
from quantpipe.runtime.model.tokenizer import Tokenizer


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    out = {
        "architectures": [cfg.architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                       "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text",
                       "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
                       "MixtralForCausalLM": "mixtral"}[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "hidden_act": cfg.hidden_act, "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)[:1] or None,
    }
    if cfg.architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        out["sliding_window"] = None
    if cfg.architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
        out.update({"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                    "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
                    "decoder_sparse_step": 1, "mlp_only_layers": dense})
    if cfg.architecture == "Qwen2MoeForCausalLM":
        out.update({"shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
                    "qkv_bias": cfg.attention_bias, "use_sliding_window": False})
    if cfg.architecture == "MixtralForCausalLM":
        out.update({"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok})
    if cfg.is_gemma3:
        # transformers 5 reads rope_parameters per layer type; older readers (vLLM's) rope_theta,
        # rope_local_base_freq and rope_scaling.
        full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
        out.update({
            "hidden_activation": cfg.hidden_act, "layer_types": list(cfg.layer_types),
            "sliding_window": cfg.sliding_window, "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
            "rope_local_base_freq": cfg.rope_local_theta,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
        })
    return out


def hf_state_dict(model: LlamaForCausalLM, prefix: str = "") -> dict[str, torch.Tensor]:
    """Our state dict with the checkpoint's names: fused q/k/v and gate/up split again.
    `prefix`: only our tensors whose names start with it ("layers.3." for one decoder layer)."""
    cfg = model.config
    out = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name if name == "lm_head.weight" else "model." + checkpoint_name(cfg, name)] = t.contiguous()

    for name, t in model.state_dict().items():
        if not name.startswith(prefix) or name.startswith("rotary.") or (
                name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if "qkv_proj" in name:
            q, k, v = t.split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                               cfg.num_kv_heads * cfg.head_dim], dim=0)
            for part, w in zip("qkv", (q, k, v)):
                put(name.replace("qkv_proj", f"{part}_proj"), w)
        elif "gate_up_proj" in name:
            gate, up = t.chunk(2, dim=0)
            put(name.replace("gate_up_proj", "gate_proj"), gate)
            put(name.replace("gate_up_proj", "up_proj"), up)
        else:
            put(name, t)
    return out


def export_hf(model: LlamaForCausalLM, tokenizer: Tokenizer | None, out_dir: str) -> str:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    dtype = model.embed_tokens.weight.dtype
    save_file(hf_state_dict(model), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(model.config, dtype), f, indent=2)
    if tokenizer is not None:
        export_tokenizer(tokenizer, out_dir)
    return out_dir


def export_tokenizer(tokenizer: Tokenizer, out_dir: str) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) into out_dir."""
    tokenizer.backend.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
        "eos_token": tokenizer.id_to_token(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None,
        "add_bos_token": tokenizer.add_bos_token,
        "chat_template": tokenizer.chat_template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
