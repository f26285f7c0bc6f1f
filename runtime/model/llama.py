"""The Llama family (Llama, Mistral, Qwen2, Qwen3) and Gemma 3 as plain PyTorch modules.

The forward pass takes a flat batch of tokens from many requests (no padding) with
their positions and the attention metadata that maps them onto the paged KV cache.
q/k/v and gate/up projections are fused into single matmuls. Gemma 3 differs in parts, not
in structure: (1 + weight) RMSNorms around both sublayers, GeGLU, a scaled embedding, and
local layers that attend to a sliding window with their own rope base (`Gemma3ForCausalLM`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

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

    @torch.no_grad()
    def divide_(self, s: torch.Tensor) -> None:
        """Divide the output's channels by s (AWQ and SmoothQuant fold their scales here)."""
        self.weight.div_(s.to(self.weight.dtype))


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), in float32 throughout, rounded once at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    @torch.no_grad()
    def divide_(self, s: torch.Tensor) -> None:
        self.weight.copy_((1.0 + self.weight.float()) / s.float() - 1.0)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """The rotary frequencies of the config's global layers, or of its local (sliding) ones."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    # float32 throughout, as the reference computes it: greedy parity depends on it.
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = None if local else cfg.rope_scaling
    if s and s["rope_type"] == "linear":  # positions divided by the factor
        inv_freq = inv_freq / s["factor"]
    elif s and s["rope_type"] == "yarn":
        inv_freq = _yarn_inv_freq(d, theta, s)
    elif s:  # llama3: stretch low frequencies, keep high ones, blend in between
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


def _yarn_inv_freq(d: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by the factor), those that turn more than beta_fast times kept, a
    linear ramp between (float32, as the reference)."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations):  # the dimension at which a frequency turns `rotations` times over old_len
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(s: dict | None) -> float:
    """YaRN's scale on cos and sin (its attention temperature); 1 for every other rope type."""
    if not s or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"]))
    return mscale(s["factor"])


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig, local: bool = False):
        super().__init__()
        self.local = local
        self.attention_factor = 1.0 if local else rope_attention_factor(cfg.rope_scaling)
        self.register_buffer("inv_freq", rope_inv_freq(cfg, local), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)  # [T, 1, D]


class Rope(NamedTuple):
    """cos/sin tables [T, 1, D] for a batch's positions: the global layers', and the local
    (sliding-window) layers' where their rope base differs."""

    full: tuple[torch.Tensor, torch.Tensor]
    sliding: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, sliding: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sliding if sliding and self.sliding is not None else self.full


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm_cls=RMSNorm):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None  # keys visible to a query
        # Attention scales scores by head_dim^-1/2; a config that asks for another scale has q pre-scaled.
        scalar = cfg.query_pre_attn_scalar
        self.q_scale = (cfg.head_dim / scalar) ** 0.5 if scalar not in (None, float(cfg.head_dim)) else None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # static 8-bit KV: [KVH] for K and V

    def forward(self, x, rope: Rope, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope.tables(self.window is not None)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        out = paged_attention(q, k, v, kv_cache, meta, window=self.window)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class GeGLU(MLP):
    """Gemma's MLP: gelu (tanh approximation) in place of silu."""

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class SparseMoE(nn.Module):
    """Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): a router (`gate`, kept in high
    precision by quantization) picks num_experts_per_tok experts per token; each expert is an
    MLP. Qwen2-MoE adds a shared expert that every token goes through, weighted per token by
    sigmoid(shared_expert_gate(x)) (that gate kept in high precision too).

    Dispatch is batched by expert: the (token, expert) pairs are sorted by expert, so each
    expert that any token picked runs one GEMM over all of its tokens, and its outputs,
    weighted by the router, are added back in expert order (as the reference adds them).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weights_in_float32 = cfg.architecture == "MixtralForCausalLM"  # Qwen3-MoE rounds them to the model dtype
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, shared) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each token's picked experts."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_in_float32 else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts))
        tokens, pair_weights = order // self.top_k, weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = tokens[start:start + n]
                y = self.experts[e](x[rows]) * pair_weights[start:start + n]
                out.index_add_(0, rows, y.to(x.dtype))
                start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if layer in cfg.moe_layers else MLP(cfg)

    # The norms whose outputs q/k/v and gate/up read (AWQ and SmoothQuant fold scales into them).
    @property
    def attn_in_norm(self):
        return self.input_layernorm

    @property
    def mlp_in_norm(self):
        return self.post_attention_layernorm

    def forward(self, x, rope: Rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Gemma3DecoderLayer(nn.Module):
    """Norms before and after each sublayer, HF's names: Gemma's post_attention_layernorm
    normalizes the attention's output, where Llama's normalizes the MLP's input."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(cfg, layer, GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GeGLU(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    @property
    def attn_in_norm(self):
        return self.input_layernorm

    @property
    def mlp_in_norm(self):
        return self.pre_feedforward_layernorm

    def forward(self, x, rope: Rope, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaForCausalLM(nn.Module):
    layer_cls, norm_cls = DecoderLayer, RMSNorm
    embed_scale: float | None = None  # the embedding's output is multiplied by it (Gemma)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg)
        local = cfg.sliding_window is not None and cfg.rope_local_theta is not None
        self.rotary_local = Rotary(cfg, local=True) if local else None
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_cache_dtype = "auto"  # the KV cache format this model is served with (kv_cache.py)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # rounded to the model dtype first, as the reference does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        local = self.rotary_local(positions, dtype) if self.rotary_local is not None else None
        return Rope(self.rotary(positions, dtype), local)

    def reset_rope(self) -> None:
        """Recompute the rotary frequencies (after building on the meta device)."""
        for r in (self.rotary, self.rotary_local):
            if r is not None:
                r.inv_freq = rope_inv_freq(self.config, r.local).to(self.embed_tokens.weight.device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, logits_rows: torch.Tensor):
        """Returns float32 logits for the rows in `logits_rows` only."""
        x = self.embed(input_ids)
        rope = self.rope(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        x = self.norm(x[logits_rows])
        return self.lm_head(x).float()


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls, norm_cls = Gemma3DecoderLayer, GemmaRMSNorm

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed_scale = cfg.hidden_size ** 0.5


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return Gemma3ForCausalLM if cfg.is_gemma3 else LlamaForCausalLM
