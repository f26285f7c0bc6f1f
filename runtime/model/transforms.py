"""Online rotations: the handler that attaches an artifact's run-time transforms to a model.

Rotations folded into the weights (QuaRot / SpinQuant's R1 and R4) leave the model code as
it is; the ones that cannot be folded rotate a module's activations as it runs, through
forward hooks added here (as compressed-tensors applies them): the model code never learns
about them, and a quantized Linear swapped in keeps its kernel.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from quantpipe.formats.artifact import OnlineTransform, check_transforms_cover
from quantpipe.runtime.model.config import ModelConfig, checkpoint_name, fused_linears


def checkpoint_modules(model: nn.Module, cfg: ModelConfig) -> dict[str, str]:
    """The model's modules by their checkpoint names -> our names; the parts of a fused
    projection (q/k/v, gate/up) map to the fused module."""
    parts = {f"layers.{i}.{ours}": [f"layers.{i}.{p}" for p in unfused]
             for i in range(cfg.num_layers) for ours, unfused in fused_linears(cfg, i)}
    out = {}
    for name, _ in model.named_modules():
        if not name or name.startswith("rotary"):
            continue
        for unfused in parts.get(name, [name]):
            out[unfused if unfused == "lm_head" else "model." + checkpoint_name(cfg, unfused)] = name
    return out


def attach(module: nn.Module, t: OnlineTransform) -> None:
    """Rotate what `module` reads (location input) or returns (output) by `t`."""
    if t.location == "input":
        module.register_forward_pre_hook(lambda _m, args: (t.apply(args[0]), *args[1:]))
    else:
        module.register_forward_hook(lambda _m, _args, out: t.apply(out))


def apply_online_transforms(model: nn.Module, cfg: ModelConfig, qcfg: dict, transforms: list[OnlineTransform]) -> None:
    """Attach each of an artifact's online transforms to its module, after checking that every
    module transform_config rotates online has one and that none is a fused projection's part."""
    modules = checkpoint_modules(model, cfg)
    fused = {ours for ours, n in Counter(modules.values()).items() if n > 1}  # q/k/v, gate/up
    check_transforms_cover(qcfg, transforms, list(modules))
    for t in transforms:
        ours = modules.get(t.module)
        if ours is None:
            raise ValueError(f"transform {t.module}.{t.location}: the model has no module {t.module}")
        if ours in fused:
            raise ValueError(f"transform {t.module}.{t.location}: {t.module} runs fused into {ours}; online "
                             f"rotations of fused projections are not supported")
        attach(model.get_submodule(ours), t)
