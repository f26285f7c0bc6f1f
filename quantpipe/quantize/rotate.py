"""Rotations before quantizing (QuaRot / SpinQuant's R1 and R4, not learned).

An orthogonal matrix Q between two Linears changes nothing in float (x W^T = (x Q)(W Q)^T)
but spreads an outlier channel over many: the activations that W8A8 quantizes per token
lose their few huge channels, and the weights their few huge columns.

- **R1**, the residual stream: one random orthogonal matrix of the hidden size. Each
  decoder layer's input norms are first folded into the Linears that read them (their
  scale moves into the weights' columns, so the norm only normalizes, which commutes with
  Q); the Linears that read the stream then take W Q, the ones that write it (o_proj,
  down_proj) Q^T W. The embeddings and lm_head take it too (the final norm's scale folded
  into lm_head first). A tied model is untied for it (`Rotator.untie`), as llm-compressor's
  SpinQuant does: lm_head becomes a copy of the embeddings, so each matrix takes R1 on its
  own side. That costs a second vocabulary matrix in the artifact, but vLLM applies
  transforms to Linear layers only, so R1 run around a shared matrix at run time (at an
  embedding's output and a norm's input) would be lost there.
- **R4**, the down projection's input: Sylvester's Hadamard matrix in blocks of
  `hadamard_block_size`, applied at run time before down_proj (its inverse folded into the
  weights), since the SiLU/GELU product in front of it is not linear.

Both are recorded as compressed-tensors' `transform_config` (artifact.py); the runtime
attaches the online ones (runtime/model/transforms.py). Gemma 3 takes R4 only: its norms
after each sublayer scale the stream's channels one by one, which does not commute with R1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from quantpipe.formats.artifact import OnlineTransform, sylvester_hadamard, transform_tensor
from quantpipe.manifest import StageError
from quantpipe.runtime.model.config import ModelConfig, checkpoint_name
from quantpipe.runtime.model.llama import RMSNorm, SparseMoE
from quantpipe.runtime.model.transforms import attach

SEED = 0  # R1's matrix: the same model and settings give the same artifact


@dataclass
class Rotated:
    """What a run's rotations did: compressed-tensors' transform_config, the online transforms'
    tensors (checkpoint names), and the manifest's summary."""

    transform_config: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def random_orthogonal(n: int, seed: int = SEED) -> torch.Tensor:
    """A random orthogonal matrix (Haar-distributed: QR of a Gaussian, signs fixed), float64."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def takes(cfg: ModelConfig, block: int) -> tuple[str, ...]:
    """The rotations this model takes: R1 but on Gemma 3, R4 where `block` divides every down
    projection's input size (what a default may apply; `check` names why a given one cannot)."""
    return tuple(r for r in ("R1", "R4") if not _refusal(cfg, (r,), block))


def check(cfg: ModelConfig, rotations: tuple[str, ...], block: int) -> None:
    """Refuse what this model cannot take, before anything is computed."""
    why = _refusal(cfg, rotations, block)
    if why:
        raise StageError(why)


def _refusal(cfg: ModelConfig, rotations: tuple[str, ...], block: int) -> str | None:
    if "R1" in rotations and cfg.is_gemma3:
        return ("rotations: R1 does not apply to Gemma 3 (its norms after each sublayer scale the residual "
                "stream per channel, which a rotation does not commute with); use R4 alone")
    if "R4" in rotations:
        sizes = {cfg.intermediate_size}
        if cfg.moe_layers:
            sizes |= {cfg.moe_intermediate_size} | ({cfg.shared_expert_intermediate_size}
                                                    if cfg.shared_expert_intermediate_size else set())
        bad = sorted(s for s in sizes if s and s % block)
        if bad:
            return f"hadamard_block_size {block} does not divide the down projection's input size {bad[0]}"
    return None


def _readers_writers(layer) -> tuple[list, list, list]:
    """(Linears reading the attention norm's output, Linears reading the MLP norm's output,
    Linears writing the residual stream) of one decoder layer."""
    mlp = layer.mlp
    if isinstance(mlp, SparseMoE):
        mlps = list(mlp.experts) + ([mlp.shared_expert] if mlp.shared_expert is not None else [])
        mlp_in = [mlp.gate] + [m.gate_up_proj for m in mlps] + (
            [mlp.shared_expert_gate] if mlp.shared_expert_gate is not None else [])
        writers = [m.down_proj for m in mlps]
    else:
        mlp_in, writers = [mlp.gate_up_proj], [mlp.down_proj]
    return [layer.self_attn.qkv_proj], mlp_in, [layer.self_attn.o_proj] + writers


class Rotator:
    """One run's rotations, applied a decoder layer at a time: the whole model at once
    (`whole`) or each layer as layer-streamed quantization reads it in (stream.py). Every
    tensor goes through the same float64 arithmetic either way, so both paths write the same
    artifact."""

    def __init__(self, cfg: ModelConfig, rotations: tuple[str, ...], block: int):
        check(cfg, rotations, block)
        self.cfg, self.block = cfg, block
        self.q = random_orthogonal(cfg.hidden_size) if "R1" in rotations else None
        self.h = sylvester_hadamard(block) if "R4" in rotations else None  # as stored: entries +-1
        self.hn = None if self.h is None else self.h.double() / math.sqrt(block)  # orthonormal, to fold
        self.tensors: dict[str, torch.Tensor] = {}
        self.untied = False  # lm_head made a matrix of its own for R1 (`untie`)

    @property
    def r1(self) -> bool:
        """R1 is applied: it folds into the embeddings and lm_head (`embedding`, `head`)."""
        return self.q is not None

    def untie(self, net) -> ModelConfig:
        """Before anything else, when R1 meets a tied model: lm_head becomes a copy of the
        embeddings (on the meta device for a layer-streamed skeleton, whose lm_head is then
        copied from the source's embeddings range by range), and the model's configuration
        says so. Returns that configuration; a model without R1 or without ties is left as is."""
        if self.q is None or not self.cfg.tie_word_embeddings:
            return self.cfg
        self.cfg = dataclasses.replace(self.cfg, tie_word_embeddings=False)
        net.config = self.cfg
        net.lm_head.weight = nn.Parameter(net.lm_head.weight.detach().clone(), requires_grad=False)
        self.untied = True
        return self.cfg

    @torch.no_grad()
    def layer(self, i: int, layer) -> None:
        """Decoder layer i, its weights in place: R1 folds its input norms into their readers and
        turns its readers and writers; R4 turns each down projection's input (hooked on)."""
        if self.q is not None:
            attn_in, mlp_in, writers = _readers_writers(layer)
            for norm, readers in ((layer.attn_in_norm, attn_in), (layer.mlp_in_norm, mlp_in)):
                if not isinstance(norm, RMSNorm):
                    raise StageError(f"rotations: R1 folds RMSNorm scales; {type(norm).__name__} is not one")
                for lin in readers:
                    lin.weight.copy_((lin.weight.double() * norm.weight.double()) @ self.q)
                norm.weight.fill_(1.0)
            for lin in writers:
                lin.weight.copy_(self.q.T @ lin.weight.double())
        if self.hn is not None:
            for local, lin in layer.named_modules():
                if not local.endswith("down_proj"):
                    continue
                lin.weight.copy_((lin.weight.double().unflatten(1, (-1, self.block)) @ self.hn).flatten(1))
                hf = "model." + checkpoint_name(self.cfg, f"layers.{i}.{local}")
                attach(lin, OnlineTransform(hf, "input", self.hn.float(), inverse=False))
                self.tensors |= transform_tensor(hf, "R4", "input", self.h)

    def embedding(self, rows: torch.Tensor) -> torch.Tensor:
        """Untied R1: embedding rows (float32) as the rotated model has them."""
        return (rows.double() @ self.q).float()

    def head(self, rows: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Untied R1: lm_head rows (float32) with the final norm's scale folded in (the norm then
        holds ones)."""
        return ((rows.double() * norm.double()) @ self.q).float()

    def result(self) -> Rotated:
        """What the artifact records, once every layer went through `layer`."""
        cfg, groups, summary = self.cfg, {}, {}
        if self.q is not None:
            weight_output = ["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$", "re:.*w2$"]
            weight_input = ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$", "re:.*gate_proj$", "re:.*up_proj$",
                            "re:.*w1$", "re:.*w3$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "lm_head"]
            if cfg.tie_word_embeddings:
                raise StageError("rotations: R1 on a tied model needs `untie` first")
            apply = [{"targets": weight_output, "location": "weight_output", "inverse": False, "ignore": []},
                     {"targets": weight_input, "location": "weight_input", "inverse": True, "ignore": []}]
            groups["R1"] = {"type": "random-matrix", "apply": apply, "randomize": False, "requires_grad": False,
                            "head_dim": None, "precision": "float32"}
            summary["R1"] = {"matrix": f"random orthogonal {cfg.hidden_size} x {cfg.hidden_size}", "seed": SEED,
                             "norms_folded": 2 * cfg.num_layers + 1, "online": [],
                             "untied": "lm_head written as a copy of the tied embeddings, each rotated on its side"
                             if self.untied else None}
        if self.hn is not None:
            targets = ["re:.*down_proj$", "re:.*w2$"]
            groups["R4"] = {"type": "hadamard", "randomize": False, "requires_grad": False, "head_dim": self.block,
                            "precision": "float32",
                            "apply": [{"targets": targets, "location": "input", "inverse": False, "ignore": []},
                                      {"targets": targets, "location": "weight_input", "inverse": True,
                                       "ignore": []}]}
            summary["R4"] = {"matrix": f"Sylvester Hadamard, blocks of {self.block}",
                             "modules": sum(k.endswith(".R4_input.weight") for k in self.tensors)}
        return Rotated({"config_groups": groups}, dict(self.tensors), summary)

    @torch.no_grad()
    def whole(self, net) -> None:
        """The whole model (float32, in memory) at once: every layer, the embeddings and lm_head
        (a tied model untied first)."""
        self.untie(net)
        for i, layer in enumerate(net.layers):
            self.layer(i, layer)
        if self.r1:
            net.embed_tokens.weight.copy_(self.embedding(net.embed_tokens.weight))
            net.lm_head.weight.copy_(self.fold_final_norm(net)(net.lm_head.weight))

    @torch.no_grad()
    def fold_final_norm(self, net):
        """Untied R1: the final norm's scale moves into lm_head (the norm then holds ones).
        Returns the map of lm_head's float32 rows, for the caller to apply to the matrix in
        memory or range by range as it is copied."""
        norm = net.norm.weight.detach().clone()
        net.norm.weight.fill_(1.0)
        return functools.partial(self.head, norm=norm)
