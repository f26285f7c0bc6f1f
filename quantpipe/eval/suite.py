"""EvalSuite: what `quantpipe eval` measures (evals/suites/*.yaml), validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import quantpipe.evals
from quantpipe.eval.mc import shipped_tasks
from quantpipe.manifest import StageError, read_yaml

DEFAULT_SUITE = Path(quantpipe.evals.__file__).resolve().parent / "suites" / "default.yaml"

_DEFAULTS = {
    "quality": {"max_texts": 256, "max_tokens": 512, "bootstrap": 1000, "seed": 0},
    "generation": {"prompts": 64, "max_tokens": 32},
    "mc": {"tasks": [], "limit": 200},
    # lm-evaluation-harness tasks (any the installed lm-eval knows, plus the shipped
    # quantpipe_bigbench_*), scored for baseline and candidates on identical requests.
    # include_path: a folder of the team's own lm-eval task YAMLs (relative to the suite file).
    "lm_eval": {"tasks": [], "num_fewshot": 0, "limit": None, "include_path": None},
    "latency": {"repeats": 2, "requests": 32, "concurrency": 8, "max_output_tokens": 64, "rate": None},
}
_LIMITS = {  # (section, key): (smallest, largest)
    ("quality", "max_texts"): (1, 100_000), ("quality", "max_tokens"): (2, 8192),
    ("quality", "bootstrap"): (100, 100_000), ("quality", "seed"): (0, 2**32 - 1),
    ("generation", "prompts"): (0, 10_000), ("generation", "max_tokens"): (1, 1024),
    ("mc", "limit"): (1, 100_000), ("lm_eval", "num_fewshot"): (0, 64),
    ("latency", "repeats"): (1, 20), ("latency", "requests"): (1, 10_000),
    ("latency", "concurrency"): (1, 1024), ("latency", "max_output_tokens"): (1, 4096),
}


@dataclass
class EvalSuite:
    quality: dict = field(default_factory=lambda: dict(_DEFAULTS["quality"]))
    generation: dict = field(default_factory=lambda: dict(_DEFAULTS["generation"]))
    mc: dict = field(default_factory=lambda: dict(_DEFAULTS["mc"]))
    lm_eval: dict = field(default_factory=lambda: dict(_DEFAULTS["lm_eval"]))
    latency: dict = field(default_factory=lambda: dict(_DEFAULTS["latency"]))
    path: str | None = None

    @classmethod
    def load(cls, path: str | None = None) -> EvalSuite:
        path = str(path or DEFAULT_SUITE)
        data = read_yaml(path, "--suite") or {}
        if not isinstance(data, dict):
            raise StageError(f"--suite {path}: must be a mapping of sections")
        unknown = set(data) - set(_DEFAULTS)
        if unknown:
            raise StageError(f"--suite {path}: unknown sections {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
        sections = {}
        for name, defaults in _DEFAULTS.items():
            given = data.get(name) or {}
            if not isinstance(given, dict) or set(given) - set(defaults):
                raise StageError(f"--suite {path}: {name} takes {sorted(defaults)}; got {given!r}")
            sections[name] = {**defaults, **given}
        include = sections["lm_eval"]["include_path"]
        if isinstance(include, str) and include:
            folder = Path(path).parent / include
            if not folder.is_dir():
                raise StageError(f"--suite {path}: lm_eval.include_path {include!r} is not a folder "
                                 f"(relative paths are read from the suite file's folder)")
            sections["lm_eval"]["include_path"] = str(folder.resolve())
        suite = cls(**sections, path=path)
        suite.validate()
        return suite

    def validate(self) -> None:
        for (section, key), (lo, hi) in _LIMITS.items():
            v = getattr(self, section)[key]
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise StageError(f"suite {section}.{key} must be an integer in [{lo}, {hi}]; got {v!r}")
        rate = self.latency["rate"]
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1000):
            raise StageError(f"suite latency.rate must be requests per second in (0, 1000], or null; got {rate!r}")
        for section in ("mc", "lm_eval"):
            tasks = getattr(self, section)["tasks"]
            if not isinstance(tasks, list) or not all(isinstance(t, str) and t for t in tasks):
                raise StageError(f"suite {section}.tasks must be a list of task names; got {tasks!r}")
        unknown = [t for t in self.mc["tasks"] if t not in shipped_tasks()]
        if unknown:
            raise StageError(f"suite mc.tasks: {', '.join(map(repr, unknown))} not shipped; known: "
                             f"{', '.join(shipped_tasks())} (other lm-eval tasks go under lm_eval.tasks)")
        if len(set(self.lm_eval["tasks"])) != len(self.lm_eval["tasks"]):
            raise StageError(f"suite lm_eval.tasks names a task twice: {self.lm_eval['tasks']!r}")
        include = self.lm_eval["include_path"]
        if include is not None and not (isinstance(include, str) and include):
            raise StageError(f"suite lm_eval.include_path must be a folder of lm-eval task YAMLs, or null; "
                             f"got {include!r}")
        limit = self.lm_eval["limit"]
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100_000):
            raise StageError(f"suite lm_eval.limit must be an integer in [1, 100000] (items per task), or null "
                             f"for all; got {limit!r}")

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "path"}
