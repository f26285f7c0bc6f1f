"""Result containers for a run or a sweep, and their JSON form (every request record included)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantpipe.runtime.bench.records import RequestRecord

SIGNALS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total")


@dataclass
class Stage:
    name: str
    mode: str  # open | closed
    target_rate: float | None = None
    concurrency: int | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    signals: dict = field(default_factory=dict)  # server metrics over this stage
    saturated: bool = False

    def to_dict(self, records: bool = True) -> dict:
        d = {k: getattr(self, k) for k in ("name", "mode", "target_rate", "concurrency", "t_start", "t_end",
                                           "summary", "signals", "saturated")}
        if records:
            d["records"] = [r.to_dict() for r in self.records]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Stage":
        recs = [RequestRecord.from_dict(r) for r in d.get("records", [])]
        return cls(**{k: v for k, v in d.items() if k != "records"}, records=recs)


@dataclass
class BenchResult:
    kind: str  # run | sweep
    meta: dict = field(default_factory=dict)
    stages: list[Stage] = field(default_factory=list)
    knee: dict | None = None
    capacity: dict | None = None
    soak: dict | None = None
    server_series: list = field(default_factory=list)  # [(t, {metric: value})]
    interrupted: bool = False
    error: str = ""

    def to_dict(self) -> dict:
        return {"kind": self.kind, "meta": self.meta, "interrupted": self.interrupted, "error": self.error,
                "knee": self.knee, "capacity": self.capacity, "soak": self.soak,
                "stages": [s.to_dict() for s in self.stages],
                "server_series": [{"t": round(t, 4), **v} for t, v in self.server_series]}

    @classmethod
    def from_dict(cls, d: dict) -> "BenchResult":
        series = [(s["t"], {k: v for k, v in s.items() if k != "t"}) for s in d.get("server_series", [])]
        return cls(kind=d["kind"], meta=d.get("meta", {}), stages=[Stage.from_dict(s) for s in d["stages"]],
                   knee=d.get("knee"), capacity=d.get("capacity"), soak=d.get("soak"), server_series=series,
                   interrupted=d.get("interrupted", False), error=d.get("error", ""))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), default=_jsonable))

    @classmethod
    def load(cls, path: str | Path) -> "BenchResult":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: not a quantpipe bench result ({e})") from None


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def summarize_signals(series: list[tuple[float, dict]]) -> dict:
    """Per server metric over a window: first, last, mean, max and slope per second."""
    out: dict[str, dict] = {}
    if not series:
        return out
    for name in SIGNALS:
        pts = [(t, v[name]) for t, v in series if name in v]
        if not pts:
            continue
        t = np.array([p[0] for p in pts])
        y = np.array([p[1] for p in pts])
        slope = float(np.polyfit(t, y, 1)[0]) if len(pts) >= 3 and np.ptp(t) > 0 else 0.0
        out[name] = {"first": float(y[0]), "last": float(y[-1]), "mean": float(y.mean()),
                     "max": float(y.max()), "slope_per_s": slope}
    return out
