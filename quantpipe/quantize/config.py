"""QuantConfig: the scheme and method of one `quantpipe quantize` run, validated once.

Scheme names are compressed-tensors' presets: W8A16 (INT8 weights per output channel,
or by group), W4A16 (INT4 by group), W8A8 (INT8 weights per channel, dynamic per-token
INT8 activations).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quantpipe.manifest import StageError
from quantpipe.quantize.rtn import WeightScheme

SCHEMES = ("W8A16", "W4A16", "W8A8", "mixed")
METHODS = ("rtn", "gptq", "awq", "autoround")
GROUP_SIZES = (32, 64, 128)
CLIPS = ("minmax", "mse")
KV_CACHES = ("none", "int8", "fp8")
ROTATIONS = ("R1", "R4")  # QuaRot / SpinQuant's residual-stream and down-projection-input rotations
# Each scheme's rotations by default. W8A8: R1 + R4 took the default model's mean KL to 0.37x
# SmoothQuant's (0.0080 against 0.0217) and its perplexity increase from +1.59% to -0.24%.
# Weight-only schemes: none. W4 g64 RTN's perplexity increase went from +42% to +101% with
# them; W4 GPTQ's fell to 0.86-0.88x with R4 alone, but R4's online Hadamard cost the int4 path
# 0.91x its decode rate (BENCHMARKS.md, "Rotations", "W4A16 GPTQ with R4: the serving cost").
ROTATED_METHODS = ("rtn", "gptq", "autoround")
DEFAULT_ROTATIONS = {"W8A8": ("R1", "R4")}
KV_STRATEGIES = ("token", "channel")  # dynamic per token and KV head; static per KV head and channel
LEARN_DTYPES = ("auto", "bfloat16", "float32")  # autoround's steps; auto: bfloat16 where the CPU has native bf16


@dataclass
class QuantConfig:
    scheme: str = "W4A16"
    group_size: int | None = None  # W4A16: 128 where it divides every layer, else 64, else 32; W8: per channel
    symmetric: bool = True
    method: str = "rtn"
    # The grid's range: min-max, or "mse": RTN takes the shrink with the least rounding error,
    # GPTQ the one with the least output error of the layer (AWQ always searches its own).
    # None: the method's best measured choice (BENCHMARKS.md), mse for GPTQ (W4 g64's perplexity
    # increase +6.8% against +22.1% with min-max) and min-max for RTN (its weight-only search
    # left W8's KL unchanged and raised W4's perplexity increase, at 7-11x the time).
    clip: str | None = None
    dampening: float = 0.01  # GPTQ: fraction of the mean Hessian diagonal added to it
    block_size: int = 128  # GPTQ: columns per lazy-update block
    # GPTQ: quantize columns by decreasing Hessian diagonal, groups and scales kept in the
    # original order (actorder "weight"). On the shipped sample it took W4 g64's perplexity
    # increase from +30.8% to +20.7% (RTN +42.3%, llm-compressor's GPTQModifier +21.9%).
    act_order: bool = True
    # autoround: sign-gradient steps per decoder layer, and calibration sequences per step
    # (auto-round's defaults; its step size is 1 / iters).
    iters: int = 200
    batch_size: int = 8
    # autoround: the dtype its steps compute in. auto: bfloat16 where the CPU has native bf16
    # (AVX-512 BF16, AMX; auto-round's amp), else float32. The rounding and ranges it learns
    # stay float32, and the errors that pick the result are float32.
    learn_dtype: str = "auto"
    calib_samples: int = 128
    calib_seq_len: int = 512
    quantize_lm_head: bool = False
    dtype: str = "bfloat16"  # scales and unquantized tensors in the artifact (what vLLM serves)
    # W8A8: SmoothQuant's migration strength (activation outliers moved into the weights, 0.5 is
    # its usual value); None: off. Off by default since the rotations below took W8A8 further:
    # mean KL 0.0080 against SmoothQuant's 0.0217 on the sample's held-out texts, and 0.0088
    # with both (BENCHMARKS.md, "Rotations").
    smoothquant_alpha: float | None = None
    bits_budget: float | None = None  # mixed: average bits per quantized weight, scales included
    # mixed: calibration sequences the per-layer KL is measured on, each cut to its first
    # sensitivity_tokens. Each Linear costs about half a forward pass per sequence and candidate
    # precision: 4 x 512 tokens took the default model's 210 Linears ~14 min on 2 cores, 4 x 128 ~4.
    sensitivity_samples: int = 4
    sensitivity_tokens: int = 128
    # mixed: the precisions a layer may take besides bf16: each bit width below 8 by group
    # (every size of mixed_group_sizes that divides the layer's input), 8 bits per channel.
    # 4 and 8 by default, the widths vLLM's compressed-tensors weight-only path loads. 3 and 6
    # as well did not pay at W4 g64's bytes on the default model: GPTQ's perplexity increase was
    # +9.3% against +6.1% over 4 and 8 only and +6.7% for uniform W4 g64 (BENCHMARKS.md,
    # "Mixed precision over 3 to 8 bits at W4's bytes").
    # mixed_group_sizes None: one size, group_size or W4A16's default for the model (each
    # further size costs another sensitivity measurement per layer and width).
    mixed_bits: tuple[int, ...] = (4, 8)
    mixed_group_sizes: tuple[int, ...] | None = None
    kv_cache: str = "none"  # K/V storage the artifact is served with: int8 or fp8 (symmetric)
    kv_cache_strategy: str = "token"  # token: scales per token and KV head at run time; channel: static, calibrated
    # Mixture of experts, GPTQ/AWQ: every expert's Hessian from every calibration token of its
    # layer, not only the tokens the router sends it (the layer's output still follows the
    # router). An expert the calibration set seldom reaches is otherwise quantized nearly blind.
    calibrate_all_experts: bool = False
    # Orthogonal rotations applied before quantizing (rotate.py): "R1" the residual stream,
    # "R4" the down projection's input (Hadamard blocks of hadamard_block_size, run online);
    # methods rtn, gptq and autoround (AWQ's scales would fold across R4's online Hadamard,
    # which they do not commute with). None: the scheme's best measured (DEFAULT_ROTATIONS), as far as
    # the model takes them (`rotations_for`); () for none.
    rotations: tuple[str, ...] | None = None
    hadamard_block_size: int = 128

    @classmethod
    def from_dict(cls, data, where: str = "quantize") -> QuantConfig:
        """A config from plain data (a recipe's candidate): every key must be a field; the
        values are then validated as a config built in code is. Errors name `where`.key."""
        if not isinstance(data, dict):
            raise StageError(f"{where}: must be a mapping of field: value; got {data!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        data = {str(k).replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise StageError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(fields))}")
        for key, value in data.items():
            want = _TYPES[key]
            ok = (value is None and key in _OPTIONAL) or (
                isinstance(value, want) and (want is bool or not isinstance(value, bool)))
            if not ok:
                kind = {str: "a string", int: "an integer", bool: "true or false",
                        (int, float): "a number", list: "a list"}.get(want, str(want))
                raise StageError(f"{where}.{key}: must be {kind}{' or null' if key in _OPTIONAL else ''}; "
                                 f"got {value!r}")
        try:
            return cls(**data)
        except StageError as e:
            raise StageError(f"{where}: {e}") from None

    def calibration_need(self) -> str | None:
        """What in this configuration needs calibration data, or None: the stage's own answer,
        which the pipeline asks instead of keeping a copy of the rule."""
        if self.method in ("gptq", "awq"):
            return self.method.upper()
        if self.method == "autoround":
            return "AutoRound"
        if self.scheme == "mixed":
            return "mixed precision (per-layer sensitivity)"
        if self.scheme == "W8A8" and self.smoothquant_alpha is not None:
            return "SmoothQuant"
        if self.kv_cache != "none" and self.kv_cache_strategy == "channel":
            return "static KV cache scales"
        return None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise StageError(f"scheme must be one of {', '.join(SCHEMES)}; got {self.scheme!r}")
        self.mixed_bits = _ints(self.mixed_bits, "mixed_bits")
        if any(not 2 <= b <= 8 for b in self.mixed_bits) or not self.mixed_bits:
            raise StageError(f"mixed_bits: bit widths from 2 to 8, at least one; got {list(self.mixed_bits)}")
        if self.mixed_group_sizes is not None:
            self.mixed_group_sizes = _ints(self.mixed_group_sizes, "mixed_group_sizes")
            if any(g not in GROUP_SIZES for g in self.mixed_group_sizes) or not self.mixed_group_sizes:
                raise StageError(f"mixed_group_sizes: each one of {', '.join(map(str, GROUP_SIZES))}, at least "
                                 f"one; got {list(self.mixed_group_sizes)}")
        if self.scheme == "mixed":
            if self.bits_budget is None:
                raise StageError("scheme mixed needs bits_budget (average bits per weight, e.g. 5)")
            least = min(self.mixed_candidates(), key=lambda s: s.bits_per_weight())
            if self.bits_budget < least.bits_per_weight():
                raise StageError(f"bits_budget {self.bits_budget} is below the smallest candidate's "
                                 f"{least.bits_per_weight():g} bits per weight ({least.describe()} with 16-bit "
                                 f"scales; mixed_bits {list(self.mixed_bits)})")
            for name in ("sensitivity_samples", "sensitivity_tokens"):
                if getattr(self, name) < 1:
                    raise StageError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.scheme == "W8A8":
            if self.group_size is not None or not self.symmetric:
                raise StageError("scheme W8A8 takes symmetric per-channel weights (no group_size, no --asymmetric)")
            if self.smoothquant_alpha is not None and not 0 < self.smoothquant_alpha < 1:
                raise StageError(f"smoothquant_alpha must be in (0, 1), got {self.smoothquant_alpha}")
        if self.method not in METHODS:
            raise StageError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.method in ("awq", "autoround") and self.scheme == "W8A8":
            raise StageError(f"method {self.method} is for weight-only schemes (W8A16, W4A16, mixed); W8A8 uses "
                             f"SmoothQuant")
        if self.method == "autoround":
            if self.clip == "mse":
                raise StageError("clip does not apply to method autoround: it learns each group's range")
            for name in ("iters", "batch_size"):
                if getattr(self, name) < 1:
                    raise StageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.learn_dtype not in LEARN_DTYPES:
            raise StageError(f"learn_dtype must be one of {', '.join(LEARN_DTYPES)}; got {self.learn_dtype!r}")
        if self.kv_cache not in KV_CACHES:
            raise StageError(f"kv_cache must be one of {', '.join(KV_CACHES)}; got {self.kv_cache!r}")
        if self.kv_cache_strategy not in KV_STRATEGIES:
            raise StageError(f"kv_cache_strategy must be one of {', '.join(KV_STRATEGIES)}; "
                             f"got {self.kv_cache_strategy!r}")
        if self.clip is None:
            self.clip = "mse" if self.method == "gptq" else "minmax"
        if self.clip not in CLIPS:
            raise StageError(f"clip must be one of {', '.join(CLIPS)}; got {self.clip!r}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise StageError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))} (or unset for "
                             f"per-channel W8); got {self.group_size}")
        if not 0 < self.dampening < 1:
            raise StageError(f"dampening must be in (0, 1), got {self.dampening}")
        if self.calibrate_all_experts and self.method not in ("gptq", "awq"):
            raise StageError(f"calibrate_all_experts chooses the tokens of GPTQ's and AWQ's Hessians; method is "
                             f"{self.method!r}")
        if self.rotations is not None:
            self._check_rotations()
        h = self.hadamard_block_size
        if h < 2 or h & (h - 1):
            raise StageError(f"hadamard_block_size must be a power of two >= 2, got {h}")
        if self.block_size < 1:
            raise StageError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("calib_samples", "calib_seq_len"):
            if getattr(self, name) < 1:
                raise StageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise StageError(f"dtype must be bfloat16, float16 or float32; got {self.dtype!r}")

    def _check_rotations(self) -> None:
        given = self.rotations.split(",") if isinstance(self.rotations, str) else self.rotations
        given = [str(r).strip().upper() for r in given if str(r).strip()]
        if given == ["NONE"]:
            given = []
        if any(r not in ROTATIONS for r in given) or len(set(given)) != len(given):
            raise StageError(f"rotations: each of {', '.join(ROTATIONS)} at most once (or none); got {given}")
        self.rotations = tuple(r for r in ROTATIONS if r in given)
        if self.rotations and self.method not in ROTATED_METHODS:
            raise StageError(f"rotations compose with methods {', '.join(ROTATED_METHODS)}; got method {self.method!r}")
        if self.rotations and self.scheme == "mixed":
            raise StageError("rotations do not compose with scheme mixed yet (its sensitivities are measured "
                             "per layer before any rotation)")

    def rotations_for(self, model_takes: tuple[str, ...]) -> tuple[str, ...]:
        """The rotations this run applies: as given, or by default the scheme's best measured
        (DEFAULT_ROTATIONS) as far as the model takes them (`model_takes`, from rotate.takes)."""
        if self.rotations is not None:
            return self.rotations
        return tuple(r for r in DEFAULT_ROTATIONS.get(self.scheme, ()) if r in model_takes)

    @property
    def num_bits(self) -> int:
        return 4 if self.scheme in ("W4A16", "mixed") else 8

    def weight_scheme(self, in_features: list[int]) -> WeightScheme:
        """The grid for this model: the group size resolved against every layer's input size.
        Scheme mixed over its own mixed_group_sizes has none: each layer takes the sizes that
        divide its input (mixed.applies)."""
        if self.scheme == "mixed" and self.mixed_group_sizes is not None:
            return WeightScheme(self.num_bits, None, self.symmetric)
        gs = self.group_size
        if self.num_bits == 4 and gs is None:
            gs = next((g for g in (128, 64, 32) if all(k % g == 0 for k in in_features)), None)
            if gs is None:
                raise StageError(f"no group size of 128, 64 or 32 divides every layer's input size "
                                 f"{sorted(set(in_features))}")
        return WeightScheme(self.num_bits, gs, self.symmetric)

    def mixed_candidates(self, resolved_group_size: int | None = None) -> list[WeightScheme]:
        """scheme mixed: the quantized precisions a layer may take (bf16 besides), before
        each layer keeps those whose group size divides its input. `resolved_group_size`:
        weight_scheme's for the model, the one size used when neither mixed_group_sizes nor
        group_size is given (without it, every size: the floor check's lower bound)."""
        one = self.group_size or resolved_group_size
        sizes = self.mixed_group_sizes or ((one,) if one else GROUP_SIZES)
        return [WeightScheme(b, None, self.symmetric) if b == 8 else WeightScheme(b, g, self.symmetric)
                for b in self.mixed_bits for g in (sizes if b < 8 else (None,))]

    def kv_cache_scheme(self) -> dict | None:
        """compressed-tensors' kv_cache_scheme: quantization args of K and V, dynamic per token."""
        if self.kv_cache == "none":
            return None
        static = self.kv_cache_strategy == "channel"
        return {"num_bits": 8, "type": "int" if self.kv_cache == "int8" else "float",
                "symmetric": True, "strategy": self.kv_cache_strategy,
                "dynamic": not static, "group_size": None, "observer": "minmax" if static else None}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ints(value, name: str) -> tuple[int, ...]:
    """A list of integers from code, YAML or the command line ("3,4,6,8"), sorted, once each."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        out = [int(str(v).strip()) for v in items if str(v).strip()]
    except (TypeError, ValueError):
        raise StageError(f"{name}: a list of integers, e.g. 3,4,6,8; got {value!r}") from None
    return tuple(sorted(set(out)))


# The type each field takes from plain data (YAML): ints are accepted where floats are.
_TYPES = {"scheme": str, "group_size": int, "symmetric": bool, "method": str, "clip": str,
          "dampening": (int, float), "block_size": int, "act_order": bool, "iters": int, "batch_size": int,
          "learn_dtype": str, "calib_samples": int, "calib_seq_len": int, "quantize_lm_head": bool, "dtype": str,
          "smoothquant_alpha": (int, float),
          "bits_budget": (int, float), "sensitivity_samples": int, "sensitivity_tokens": int, "kv_cache": str,
          "kv_cache_strategy": str, "calibrate_all_experts": bool, "rotations": list,
          "hadamard_block_size": int, "mixed_bits": list, "mixed_group_sizes": list}
_OPTIONAL = {"group_size", "clip", "smoothquant_alpha", "bits_budget", "rotations", "mixed_group_sizes"}  # null is a value of these
assert set(_TYPES) == {f.name for f in dataclasses.fields(QuantConfig)}, "every field needs a type for from_dict"
