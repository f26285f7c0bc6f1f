"""PipelineRecipe: what `quantpipe pipeline` (and `make quantize`) runs, as plain data.

One YAML file names every stage's configuration (llm-compressor's "a recipe is data"):

    name: smollm2                 # artifacts/NAME/<candidate>, reports/NAME, the registered model (null: the model's)
    calibrate:                    # a calibrate recipe file, then any CalibConfig field over it;
      recipe: calib_sets/recipes/sample.yaml   # or `set: DIR`, an existing calibration set
    candidates:                   # each a full QuantConfig (any `quantpipe quantize` field), plus a name
      - {name: w8a16-rtn, scheme: W8A16, method: rtn}
    kernels: {build: auto}        # auto: build and verify Triton kernels on CUDA; off: never
    eval: {suite: evals/suites/default.yaml, kv_tokens: 32768}   # KV tokens a server holds: the cost order
    gate: {policy: evals/gates/default.yaml}
    publish: {enabled: true, name: null, registry: null}

Everything is validated once, when the recipe loads and before any stage runs; an error
names the key (`candidates[2].group_size`) and what it takes. Each stage's config object
(CalibConfig, QuantConfig, EvalSuite, the gate policy) does its own validation: the
recipe only routes the keys to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import quantpipe.evals
from quantpipe.manifest import StageError, read_yaml, sha256_file
from quantpipe.registry.publish import MODEL_NAME

DEFAULT_RECIPE = Path(quantpipe.evals.__file__).resolve().parent / "recipes" / "default.yaml"
SECTIONS = ("name", "calibrate", "candidates", "kernels", "eval", "gate", "publish")
KERNEL_BUILDS = ("auto", "off")
RESERVED = ("quality", "search.json", "search.html")  # reports/NAME/ entries beside the candidates' folders


@dataclass(frozen=True)
class Candidate:
    name: str
    config: object  # QuantConfig (typed loosely so this module stays importable without torch)


@dataclass
class PipelineRecipe:
    name: str
    calib_recipe: str | None = None  # a calibrate recipe file
    calib_fields: dict = field(default_factory=dict)  # CalibConfig fields over it
    calib_set: str | None = None  # an existing calibration set instead
    candidates: list[Candidate] = field(default_factory=list)
    kernels_build: str = "auto"
    suite: str | None = None
    kv_tokens: int = 32768  # tokens in the KV cache when serving: serving bytes = weights + KV of this many
    policy: str | None = None
    publish: bool = True
    publish_name: str | None = None
    registry: str | None = None
    path: str | None = None
    sha256: str | None = None

    @classmethod
    def load(cls, path: str | None = None) -> PipelineRecipe:
        path = str(path or DEFAULT_RECIPE)
        data = read_yaml(path, "--recipe")
        if not isinstance(data, dict):
            raise StageError(f"--recipe {path}: must be a mapping with the sections {', '.join(SECTIONS)}")
        return cls.from_dict(data, where=f"--recipe {path}", path=path, sha256=sha256_file(path))

    @classmethod
    def from_dict(cls, data: dict, where: str = "recipe", path: str | None = None,
                  sha256: str | None = None) -> PipelineRecipe:
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise StageError(f"{where}: unknown section {unknown[0]!r}; known: {', '.join(SECTIONS)}")
        name = data.get("name", "quantpipe")
        if name is not None:  # null: named after the model (run.model_name)
            check_name(name, f"{where}: name")
        calib = _section(data, "calibrate", where)
        kernels = _section(data, "kernels", where, allowed=("build",))
        ev = _section(data, "eval", where, allowed=("suite", "kv_tokens"))
        gt = _section(data, "gate", where, allowed=("policy",))
        pub = _section(data, "publish", where, allowed=("enabled", "name", "registry"))
        build = kernels.get("build", "auto")
        if build not in KERNEL_BUILDS:
            raise StageError(f"{where}: kernels.build must be one of {', '.join(KERNEL_BUILDS)}; got {build!r}")
        for key, value in (("eval.suite", ev.get("suite")), ("gate.policy", gt.get("policy")),
                           ("publish.registry", pub.get("registry"))):
            if value is not None and not isinstance(value, str):
                raise StageError(f"{where}: {key} must be a path (a string); got {value!r}")
        kv_tokens = ev.get("kv_tokens", 32768)
        if not isinstance(kv_tokens, int) or isinstance(kv_tokens, bool) or not 0 <= kv_tokens <= 10**9:
            raise StageError(f"{where}: eval.kv_tokens must be an integer in [0, 1000000000]; got {kv_tokens!r}")
        enabled = pub.get("enabled", True)
        if not isinstance(enabled, bool):
            raise StageError(f"{where}: publish.enabled must be true or false; got {enabled!r}")
        if pub.get("name") is not None:
            check_name(pub["name"], f"{where}: publish.name")
        recipe = cls(name=name, kernels_build=build, suite=ev.get("suite"), kv_tokens=kv_tokens,
                     policy=gt.get("policy"),
                     publish=enabled, publish_name=pub.get("name"), registry=pub.get("registry"),
                     path=path, sha256=sha256)
        recipe = recipe.with_calibrate(calib, where)
        cands = data.get("candidates")
        if not isinstance(cands, list) or not cands:
            raise StageError(f"{where}: candidates must be a non-empty list of quantize configurations")
        return recipe.with_candidates(cands, where)

    def with_calibrate(self, calib: dict, where: str = "recipe") -> PipelineRecipe:
        """The calibrate section: `set` alone, or `recipe` and/or CalibConfig fields."""
        calib = dict(calib)
        calib_set, calib_recipe = calib.pop("set", None), calib.pop("recipe", None)
        if calib_set is not None:
            if calib_recipe is not None or calib:
                raise StageError(f"{where}: calibrate.set (an existing calibration set) takes no other key; "
                                 f"got {sorted(['recipe'] * (calib_recipe is not None) + list(calib))}")
            if not isinstance(calib_set, str):
                raise StageError(f"{where}: calibrate.set must be a folder path; got {calib_set!r}")
            return replace(self, calib_set=calib_set, calib_recipe=None, calib_fields={})
        if calib_recipe is not None and not isinstance(calib_recipe, str):
            raise StageError(f"{where}: calibrate.recipe must be a file path; got {calib_recipe!r}")
        if calib_recipe is None and not calib.get("logs"):
            raise StageError(f"{where}: calibrate needs `recipe` (a calibrate recipe file), `logs`, or `set`")
        out = replace(self, calib_set=None, calib_recipe=calib_recipe, calib_fields=calib)
        out.calib_config(where=where)  # validated now, not when the stage runs
        return out

    def calib_config(self, out: str | None = None, model: str | None = None, where: str = "recipe"):
        """The CalibConfig the calibrate stage runs with (fields named `calibrate.KEY` in errors)."""
        import dataclasses

        from quantpipe.calibrate import CalibConfig

        known = {f.name for f in dataclasses.fields(CalibConfig)} - {"out", "overwrite", "model"}
        fields = {k.replace("-", "_"): v for k, v in self.calib_fields.items()}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise StageError(f"{where}: unknown key calibrate.{unknown[0]}; known: recipe, set, "
                             f"{', '.join(sorted(known))}")
        try:
            if self.calib_recipe:
                return CalibConfig.from_recipe(self.calib_recipe, out=out, model=model, overwrite=True, **fields)
            return CalibConfig(**fields, out=out, model=model, overwrite=True)
        except (StageError, TypeError) as e:  # TypeError: a value of the wrong kind reached a check
            raise StageError(f"{where}: calibrate: {e}") from None

    def with_candidates(self, cands: list, where: str = "recipe") -> PipelineRecipe:
        from quantpipe.quantize.config import QuantConfig

        out, names = [], set()
        for i, c in enumerate(cands):
            at = f"{where}: candidates[{i}]"
            if not isinstance(c, dict):
                raise StageError(f"{at}: must be a mapping of quantize fields; got {c!r}")
            c = dict(c)
            name = c.pop("name", None)
            cfg = QuantConfig.from_dict(c, at)
            name = name if name is not None else default_name(cfg)
            check_name(name, f"{at}.name")
            if name in RESERVED or name.startswith("latency-"):
                raise StageError(f"{at}.name: {name!r} is a name the pipeline's own reports use "
                                 f"({', '.join(RESERVED)}, latency-*); choose another")
            if name in names:
                raise StageError(f"{at}.name: {name!r} is used by another candidate; names must be unique")
            names.add(name)
            out.append(Candidate(name, cfg))
        return replace(self, candidates=out)

    def to_dict(self) -> dict:
        """What ran: every stage's resolved configuration (recorded in the search report)."""
        return {"name": self.name, "path": self.path, "sha256": self.sha256,
                "calibrate": {"set": self.calib_set} if self.calib_set else
                {"recipe": self.calib_recipe, **self.calib_fields},
                "candidates": [{"name": c.name, **c.config.to_dict()} for c in self.candidates],
                "kernels": {"build": self.kernels_build}, "eval": {"suite": self.suite, "kv_tokens": self.kv_tokens},
                "gate": {"policy": self.policy},
                "publish": {"enabled": self.publish, "name": self.publish_name, "registry": self.registry}}


def default_name(cfg) -> str:
    """w4a16-g64-gptq-mse-kv-int8 and the like: what a candidate is called unless named."""
    parts = [cfg.scheme.lower()]
    if cfg.scheme == "mixed" and cfg.bits_budget is not None:
        parts.append(f"{cfg.bits_budget:g}b")
        if cfg.mixed_bits != type(cfg).mixed_bits:
            parts.append("w" + "".join(map(str, cfg.mixed_bits)))
        if cfg.mixed_group_sizes:
            parts.append("g" + "-".join(map(str, cfg.mixed_group_sizes)))
    if cfg.group_size:
        parts.append(f"g{cfg.group_size}")
    parts.append(cfg.method)
    if cfg.clip != "minmax":
        parts.append(cfg.clip)
    if cfg.rotations:
        parts.append("".join(r.lower() for r in cfg.rotations))
    if cfg.kv_cache != "none":
        parts.append(f"kv-{cfg.kv_cache}" + ("-channel" if cfg.kv_cache_strategy == "channel" else ""))
    return "-".join(parts)


def _section(data: dict, key: str, where: str, allowed: tuple[str, ...] | None = None) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise StageError(f"{where}: {key} must be a mapping; got {value!r}")
    if allowed is not None:
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise StageError(f"{where}: unknown key {key}.{unknown[0]}; known: {', '.join(allowed)}")
    return value


def check_name(name, where: str) -> None:
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
        raise StageError(f"{where} must be 1-100 letters, digits, '.', '_' or '-' (a folder and registry name); "
                         f"got {name!r}")
