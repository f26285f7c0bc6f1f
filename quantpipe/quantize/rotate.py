"""Rotations before quantizing (QuaRot / SpinQuant's R1 and R4, not learned).

An orthogonal matrix Q between two Linears changes nothing in float (x W^T = (x Q)(W Q)^T)
but spreads an outlier channel over many: the activations that W8A8 quantizes per token
lose their few huge channels, and the weights their few huge columns.

- **R1**, the residual stream: one random orthogonal matrix of the hidden size. Each
  decoder layer's input norms are first folded into the Linears that read them (their
  scale moves into the weights' columns, so the norm only normalizes, which commutes with
  Q); the Linears that read the stream then take W Q, the ones that write it (o_proj,
  down_proj) Q^T W. The embeddings and lm_head take it too when they are separate
  matrices; when they are tied, the embedding's output is rotated at run time and the
  final norm's input rotated back (two [hidden x hidden] products per token, instead of a
  second copy of the vocabulary matrix).
- **R4**, the down projection's input: Sylvester's Hadamard matrix in blocks of
  `hadamard_block_size`, applied at run time before down_proj (its inverse folded into the
  weights), since the SiLU/GELU product in front of it is not linear.

Both are recorded as compressed-tensors' `transform_config` (artifact.py); the runtime
attaches the online ones (runtime/model/transforms.py). Gemma 3 takes R4 only: its norms
after each sublayer scale the stream's channels one by one, which does not commute with R1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantpipe.formats.artifact import OnlineTransform, sylvester_hadamard, transform_tensor
from quantpipe.manifest import StageError
from quantpipe.runtime.model.config import ModelConfig, checkpoint_name
from quantpipe.runtime.model.llama import RMSNorm, SparseMoE
from quantpipe.runtime.model.transforms import attach

SEED = 0  # R1's matrix: the same model and settings give the same artifact


@dataclass
class Rotated:
    """What `rotate` did: compressed-tensors' transform_config, the online transforms'
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


def _down_projs(net) -> list[tuple[str, torch.nn.Linear]]:
    return [(n, m) for n, m in net.named_modules() if n.endswith("down_proj")]


@torch.no_grad()
def rotate(net, cfg: ModelConfig, rotations: tuple[str, ...], block: int) -> Rotated:
    """Apply `rotations` to `net` (float32, whole) in place: weights rotated, the online parts
    hooked on so that calibration sees what serving will. Returns what the artifact records."""
    check(cfg, rotations, block)
    groups, tensors, summary = {}, {}, {}
    if "R1" in rotations:
        q = random_orthogonal(cfg.hidden_size)
        for layer in net.layers:
            attn_in, mlp_in, writers = _readers_writers(layer)
            for norm, readers in ((layer.attn_in_norm, attn_in), (layer.mlp_in_norm, mlp_in)):
                if not isinstance(norm, RMSNorm):
                    raise StageError(f"rotations: R1 folds RMSNorm scales; {type(norm).__name__} is not one")
                for lin in readers:
                    lin.weight.copy_((lin.weight.double() * norm.weight.double()) @ q)
                norm.weight.fill_(1.0)
            for lin in writers:
                lin.weight.copy_(q.T @ lin.weight.double())
        weight_output = ["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$", "re:.*w2$"]
        weight_input = ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$", "re:.*gate_proj$", "re:.*up_proj$",
                        "re:.*w1$", "re:.*w3$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "lm_head"]
        apply = []
        if cfg.tie_word_embeddings:  # the vocabulary matrix stays as it is: rotate around it at run time
            weight_output, weight_input = weight_output[1:], weight_input[:-1]
            embed = OnlineTransform("model.embed_tokens", "output", q.float(), inverse=False)
            final = OnlineTransform("model.norm", "input", q.float(), inverse=True)
            attach(net.embed_tokens, embed)
            attach(net.norm, final)
            apply += [{"targets": ["re:^model\\.embed_tokens$"], "location": "output", "inverse": False, "ignore": []},
                      {"targets": ["re:^model\\.norm$"], "location": "input", "inverse": True, "ignore": []}]
            tensors |= transform_tensor("model.embed_tokens", "R1", "output", q)
            tensors |= transform_tensor("model.norm", "R1", "input", q)
        else:
            net.embed_tokens.weight.copy_(net.embed_tokens.weight.double() @ q)
            net.lm_head.weight.copy_((net.lm_head.weight.double() * net.norm.weight.double()) @ q)
            net.norm.weight.fill_(1.0)
        apply += [{"targets": weight_output, "location": "weight_output", "inverse": False, "ignore": []},
                  {"targets": weight_input, "location": "weight_input", "inverse": True, "ignore": []}]
        groups["R1"] = {"type": "random-matrix", "apply": apply, "randomize": False, "requires_grad": False,
                        "head_dim": None, "precision": "float32"}
        summary["R1"] = {"matrix": f"random orthogonal {cfg.hidden_size} x {cfg.hidden_size}", "seed": SEED,
                         "norms_folded": 2 * cfg.num_layers + (0 if cfg.tie_word_embeddings else 1),
                         "online": ["model.embed_tokens output", "model.norm input"] if cfg.tie_word_embeddings
                         else []}
    if "R4" in rotations:
        h = sylvester_hadamard(block)
        hn = h.double() / math.sqrt(block)
        downs = _down_projs(net)
        for name, lin in downs:
            w = lin.weight.double()
            lin.weight.copy_((w.unflatten(1, (-1, block)) @ hn).flatten(1))
            hf = "model." + checkpoint_name(cfg, name)
            attach(lin, OnlineTransform(hf, "input", hn.float(), inverse=False))
            tensors |= transform_tensor(hf, "R4", "input", h)
        targets = ["re:.*down_proj$", "re:.*w2$"]
        groups["R4"] = {"type": "hadamard", "randomize": False, "requires_grad": False, "head_dim": block,
                        "precision": "float32",
                        "apply": [{"targets": targets, "location": "input", "inverse": False, "ignore": []},
                                  {"targets": targets, "location": "weight_input", "inverse": True, "ignore": []}]}
        summary["R4"] = {"matrix": f"Sylvester Hadamard, blocks of {block}", "modules": len(downs)}
    return Rotated({"config_groups": groups}, tensors, summary)
