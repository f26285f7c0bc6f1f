"""CalibConfig: every knob of `quantpipe calibrate`, as plain data a recipe file can hold.

A recipe (calib_sets/recipes/*.yaml) uses the same field names; command-line flags
override it. Everything is validated once, here, with errors that name the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quantpipe.manifest import StageError

FORMATS = ("auto", "request-log", "chat", "batch", "jsonl", "csv", "parquet")
ALLOCATIONS = ("proportional", "neyman")
STATUSES = ("ok", "error", "rejected", "aborted", "timeout")
PLAIN_STRATA = ("endpoint", "model", "length", "cluster")


@dataclass
class CalibConfig:
    logs: list[str] = field(default_factory=list)  # files or globs; .gz and .zst are read too
    out: str | None = None
    format: str = "auto"
    text_field: str | None = None  # generic JSONL/CSV/Parquet: the column holding the text
    label_field: str | None = None  # generic: a column to stratify by (as `label`)
    model: str | None = None  # tokenizer and chat template; None: the default model
    strata: list[str] = field(default_factory=lambda: ["length"])
    size: int = 512
    heldout_size: int = 256
    min_per_stratum: int = 16
    allocation: str = "proportional"
    seed: int = 0
    min_tokens: int = 16
    include_status: list[str] = field(default_factory=lambda: ["ok"])
    max_bad_lines: float = 0.01  # fraction of lines that may be malformed before the run aborts
    near_dup_threshold: float = 0.8  # estimated Jaccard similarity of shingles; 1.0: identical after normalization
    length_edges: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048])
    cluster_k: list[int] = field(default_factory=lambda: [2, 12])  # k range searched by silhouette
    allow_smaller: bool = False
    overwrite: bool = False
    # Processes for the first pass; None: one per core for logs over 32 MiB, else in-process.
    # The output does not depend on it (so it is not a sampling parameter in the manifest).
    workers: int | None = None
    # A Ray cluster's address (or RAY_ADDRESS): the first pass runs there through Ray Data.
    # Like workers, it changes where the work runs, never the sets.
    ray: str | None = None

    def __post_init__(self) -> None:
        self.strata = _as_list(self.strata, "strata")
        self.include_status = _as_list(self.include_status, "include_status")
        self.logs = _as_list(self.logs, "logs")
        if self.format not in FORMATS:
            raise StageError(f"format must be one of {', '.join(FORMATS)}; got {self.format!r}")
        if self.allocation not in ALLOCATIONS:
            raise StageError(f"allocation must be one of {', '.join(ALLOCATIONS)}; got {self.allocation!r}")
        for name in ("size", "min_per_stratum", "min_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise StageError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.heldout_size, int) or self.heldout_size < 0:
            raise StageError(f"heldout_size must be an integer >= 0, got {self.heldout_size!r}")
        if not 0 <= self.max_bad_lines < 1:
            raise StageError(f"max_bad_lines must be a fraction in [0, 1), got {self.max_bad_lines!r}")
        if not 0 < self.near_dup_threshold <= 1:
            raise StageError(f"near_dup_threshold must be in (0, 1], got {self.near_dup_threshold!r}")
        bad = [s for s in self.include_status if s not in STATUSES]
        if bad:
            raise StageError(f"include_status: unknown status {bad[0]!r}; known: {', '.join(STATUSES)}")
        if not self.strata:
            raise StageError("strata must name at least one key (for example length or metadata.task)")
        for key in self.strata:
            if key not in PLAIN_STRATA and not key.startswith("metadata.") and key != "label":
                raise StageError(f"strata: unknown key {key!r}; use {', '.join(PLAIN_STRATA)}, label, "
                                 f"or metadata.<name>")
        if len(set(self.strata)) != len(self.strata):
            raise StageError(f"strata: a key is repeated in {self.strata}")
        edges = self.length_edges
        if not edges or any(not isinstance(e, int) or e < 1 for e in edges) or sorted(set(edges)) != list(edges):
            raise StageError(f"length_edges must be increasing positive integers, got {edges!r}")
        if (len(self.cluster_k) != 2 or not all(isinstance(k, int) for k in self.cluster_k)
                or not 2 <= self.cluster_k[0] <= self.cluster_k[1]):
            raise StageError(f"cluster_k must be [low, high] with 2 <= low <= high, got {self.cluster_k!r}")
        if self.workers is not None and (not isinstance(self.workers, int) or not 1 <= self.workers <= 64):
            raise StageError(f"workers must be an integer from 1 to 64, got {self.workers!r}")
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray.strip()):
            raise StageError(f"ray must be a cluster address (host:port, ray://host:port or auto), got {self.ray!r}")
        if "label" in self.strata and not self.label_field:
            raise StageError("strata: 'label' needs label_field (the column to stratify by)")

    @classmethod
    def from_recipe(cls, path: str, **overrides) -> CalibConfig:
        """A recipe file's values, then `overrides` (None values are ignored: flags not given)."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise StageError(f"--recipe {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise StageError(f"--recipe {path}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise StageError(f"--recipe {path}: must be a mapping of field: value")
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StageError(f"--recipe {path}: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("out", "overwrite", "workers", "ray"):  # where and how fast, not what is sampled
            d.pop(name)
        return d


def _as_list(value, name: str) -> list:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise StageError(f"{name} must be a list or a comma-separated string, got {value!r}")
