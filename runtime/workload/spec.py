"""WorkloadSpec: what traffic looks like, loadable from YAML, JSON or a dict.

Example (YAML):

    name: my-chat
    seed: 0
    num_requests: 500          # and/or duration_s: 60
    prompt_tokens: {dist: lognormal, median: 256, sigma: 0.8, min: 16, max: 1536}
    output_tokens: {dist: lognormal, median: 128, sigma: 0.7, min: 8, max: 384}
    ignore_eos: true           # ask the server for exactly output_tokens tokens
    arrival: {process: gamma, rate: 4, cv: 2, bursts: [{at_s: 30, duration_s: 5, factor: 3}]}
    shared_prefix: {num_prefixes: 4, prefix_tokens: 512, fraction: 0.5}
    sessions: {turns: {dist: uniform, low: 1, high: 4}, think_time_s: 5}
    dataset: {path: sharegpt.json, format: sharegpt}   # real prompts instead of corpus cuts

Validation errors name the offending field: "workload.prompt_tokens.sigma must be > 0, got -1".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from quantpipe.runtime.workload.arrivals import ArrivalSpec
from quantpipe.runtime.workload.lengths import LengthDist, _num


@dataclass(frozen=True)
class SharedPrefix:
    num_prefixes: int  # distinct system prompts
    prefix_tokens: int  # length of each, prepended to the sampled prompt
    fraction: float  # share of requests that use one (chosen uniformly)


@dataclass(frozen=True)
class Sessions:
    turns: LengthDist  # turns per session
    think_time_s: float = 0.0  # pause after a reply before the next turn is sent


@dataclass(frozen=True)
class Dataset:
    path: str
    format: str = "auto"  # sharegpt | jsonl | auto


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "custom"
    seed: int = 0
    num_requests: int | None = 100
    duration_s: float | None = None
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", {"value": 256}))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", {"value": 128}))
    ignore_eos: bool = True
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    shared_prefix: SharedPrefix | None = None
    sessions: Sessions | None = None
    dataset: Dataset | None = None

    # ---- loading ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any, base_dir: Path | None = None) -> "WorkloadSpec":
        w = "workload"
        if not isinstance(d, dict):
            raise ValueError(f"{w} must be a mapping, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{w}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        kw: dict[str, Any] = {}
        if "name" in d:
            kw["name"] = str(d["name"])
        if "seed" in d:
            if not isinstance(d["seed"], int) or isinstance(d["seed"], bool):
                raise ValueError(f"{w}.seed must be an integer, got {d['seed']!r}")
            kw["seed"] = d["seed"]
        n = d.get("num_requests", None if "duration_s" in d else 100)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"{w}.num_requests must be an integer >= 1, got {n!r}")
        kw["num_requests"] = n
        if d.get("duration_s") is not None:
            kw["duration_s"] = _num(d, "duration_s", w, positive=True)
        for key in ("prompt_tokens", "output_tokens"):
            if key in d:
                kw[key] = LengthDist.from_dict(d[key], f"{w}.{key}", base_dir)
        if "ignore_eos" in d:
            kw["ignore_eos"] = bool(d["ignore_eos"])
        if "arrival" in d:
            arr = dict(d["arrival"]) if isinstance(d["arrival"], dict) else d["arrival"]
            if isinstance(arr, dict) and arr.get("path") and base_dir and not Path(arr["path"]).is_absolute():
                arr["path"] = str(base_dir / arr["path"])
            kw["arrival"] = ArrivalSpec.from_dict(arr, f"{w}.arrival")
        if d.get("shared_prefix") is not None:
            sp, ws = d["shared_prefix"], f"{w}.shared_prefix"
            if not isinstance(sp, dict):
                raise ValueError(f"{ws} must be a mapping")
            frac = _num(sp, "fraction", ws, default=1.0)
            if not 0 <= frac <= 1:
                raise ValueError(f"{ws}.fraction must be in [0, 1], got {frac}")
            kw["shared_prefix"] = SharedPrefix(int(_num(sp, "num_prefixes", ws, positive=True)),
                                               int(_num(sp, "prefix_tokens", ws, positive=True)), frac)
        if d.get("sessions") is not None:
            ss, wss = d["sessions"], f"{w}.sessions"
            if not isinstance(ss, dict):
                raise ValueError(f"{wss} must be a mapping")
            think = _num(ss, "think_time_s", wss, default=0.0)
            if think < 0:
                raise ValueError(f"{wss}.think_time_s must be >= 0, got {think}")
            kw["sessions"] = Sessions(LengthDist.from_dict(ss.get("turns", 2), f"{wss}.turns"), think)
        if d.get("dataset") is not None:
            ds, wd = d["dataset"], f"{w}.dataset"
            if not isinstance(ds, dict) or not ds.get("path"):
                raise ValueError(f"{wd}.path is required")
            p = Path(ds["path"])
            if base_dir and not p.is_absolute():
                p = base_dir / p
            fmt = ds.get("format", "auto")
            if fmt not in ("auto", "sharegpt", "jsonl"):
                raise ValueError(f"{wd}.format must be auto, sharegpt or jsonl, got {fmt!r}")
            kw["dataset"] = Dataset(str(p), fmt)
        spec = cls(**kw)
        if spec.num_requests is None and spec.duration_s is None and spec.arrival.process != "trace":
            raise ValueError(f"{w}: set num_requests or duration_s")
        return spec

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "name": self.name, "seed": self.seed, "num_requests": self.num_requests,
            "duration_s": self.duration_s, "prompt_tokens": self.prompt_tokens.to_dict(),
            "output_tokens": self.output_tokens.to_dict(), "ignore_eos": self.ignore_eos,
            "arrival": self.arrival.to_dict(),
        }
        if self.shared_prefix:
            d["shared_prefix"] = self.shared_prefix.__dict__.copy()
        if self.sessions:
            d["sessions"] = {"turns": self.sessions.turns.to_dict(), "think_time_s": self.sessions.think_time_s}
        if self.dataset:
            d["dataset"] = self.dataset.__dict__.copy()
        return d

    # ---- derived specs ------------------------------------------------------------
    def with_rate(self, rate: float) -> "WorkloadSpec":
        return replace(self, arrival=self.arrival.with_rate(rate))

    def scaled_lengths(self, f: float) -> "WorkloadSpec":
        sp = self.shared_prefix
        if sp:
            sp = replace(sp, prefix_tokens=max(1, round(sp.prefix_tokens * f)))
        return replace(self, prompt_tokens=self.prompt_tokens.scaled(f),
                       output_tokens=self.output_tokens.scaled(f), shared_prefix=sp)


def load_workload(source: str | Path | dict) -> WorkloadSpec:
    """A spec from a dict, a YAML/JSON file path, or a preset name (see presets.PRESETS)."""
    if isinstance(source, dict):
        return WorkloadSpec.from_dict(source)
    from quantpipe.runtime.workload.presets import PRESETS, preset

    if str(source) in PRESETS:
        return preset(str(source))
    path = Path(source)
    if not path.exists():
        raise ValueError(f"workload {source!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    return WorkloadSpec.from_dict(data, base_dir=path.parent)
