"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as plain PyTorch modules.

The forward pass takes a flat batch of tokens from many requests (no padding) with
their positions and the attention metadata that maps them onto the paged KV cache.
q/k/v and gate/up projections are fused into single matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from quantpipe.runtime.model.attention import AttentionMetadata, paged_attention
from quantpipe.runtime.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and scale in the model dtype, as the reference does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    # float32 throughout, as the reference computes it: greedy parity depends on it.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s:  # llama3: stretch low frequencies, keep high ones, blend in between
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)  # [T, 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # static 8-bit KV: [KVH] for K and V

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_cache_dtype = "auto"  # the KV cache format this model is served with (kv_cache.py)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, logits_rows: torch.Tensor):
        """Returns float32 logits for the rows in `logits_rows` only."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        x = self.norm(x[logits_rows])
        return self.lm_head(x).float()
