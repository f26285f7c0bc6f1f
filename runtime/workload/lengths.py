"""Token-length distributions: fixed, uniform, normal, lognormal, quantiles, mixture, empirical.

Every distribution samples integers clipped to [min, max]; `scaled(f)` multiplies all
lengths by f so a preset sized for a GPU server can be shrunk for a small CPU machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("fixed", "uniform", "normal", "lognormal", "quantiles", "mixture", "empirical")


def _num(d: dict, key: str, where: str, *, positive: bool = False, default: Any = None) -> float:
    if key not in d:
        if default is not None:
            return default
        raise ValueError(f"{where}.{key} is required")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{where}.{key} must be a finite number, got {v!r}")
    if positive and v <= 0:
        raise ValueError(f"{where}.{key} must be > 0, got {v}")
    return float(v)


@dataclass(frozen=True)
class LengthDist:
    kind: str
    params: dict[str, float] = field(default_factory=dict)
    min: int = 1
    max: int = 1_000_000
    # mixture: (weight, component) pairs; empirical: the observed values
    components: tuple[tuple[float, "LengthDist"], ...] = ()
    values: tuple[int, ...] = ()

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any, where: str, base_dir: Path | None = None) -> "LengthDist":
        if isinstance(d, (int, float)) and not isinstance(d, bool):
            d = {"dist": "fixed", "value": d}
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a mapping or a number, got {d!r}")
        kind = d.get("dist", d.get("kind"))
        if kind not in KINDS:
            raise ValueError(f"{where}.dist must be one of {', '.join(KINDS)}, got {kind!r}")
        lo = int(_num(d, "min", where, default=1))
        hi = int(_num(d, "max", where, default=1_000_000))
        if lo < 1:
            raise ValueError(f"{where}.min must be >= 1, got {lo}")
        if hi < lo:
            raise ValueError(f"{where}.max must be >= min ({lo}), got {hi}")
        params: dict[str, float] = {}
        comps: list[tuple[float, LengthDist]] = []
        values: tuple[int, ...] = ()
        if kind == "fixed":
            params["value"] = _num(d, "value", where, positive=True)
        elif kind == "uniform":
            params["low"] = _num(d, "low", where, positive=True)
            params["high"] = _num(d, "high", where, positive=True)
            if params["high"] < params["low"]:
                raise ValueError(f"{where}.high must be >= low ({params['low']}), got {params['high']}")
        elif kind == "normal":
            params["mean"] = _num(d, "mean", where, positive=True)
            params["std"] = _num(d, "std", where, positive=True)
        elif kind == "lognormal":
            params["median"] = _num(d, "median", where, positive=True)
            params["sigma"] = _num(d, "sigma", where, positive=True)
        elif kind == "quantiles":
            # Piecewise log-linear inverse CDF through published percentiles, e.g.
            # {0: 16, 0.5: 1020, 0.9: 2734, 0.99: 4142, 1: 8192}; needs the 0 and 1 knots.
            pts = d.get("points")
            if not isinstance(pts, dict) or len(pts) < 2:
                raise ValueError(f"{where}.points must map quantile -> length (at least 2 knots)")
            knots = sorted((float(q), float(v)) for q, v in pts.items())
            if knots[0][0] != 0.0 or knots[-1][0] != 1.0:
                raise ValueError(f"{where}.points must include quantiles 0 and 1, got {[q for q, _ in knots]}")
            if any(v <= 0 for _, v in knots) or any(b[1] < a[1] for a, b in zip(knots, knots[1:])):
                raise ValueError(f"{where}.points values must be > 0 and non-decreasing")
            params = {f"q{q:g}": v for q, v in knots}
        elif kind == "mixture":
            raw = d.get("components")
            if not isinstance(raw, list) or not raw:
                raise ValueError(f"{where}.components must be a non-empty list")
            for i, c in enumerate(raw):
                if not isinstance(c, dict):
                    raise ValueError(f"{where}.components[{i}] must be a mapping")
                w = _num(c, "weight", f"{where}.components[{i}]", positive=True)
                sub = {k: v for k, v in c.items() if k != "weight"}
                comps.append((w, cls.from_dict(sub, f"{where}.components[{i}]", base_dir)))
        elif kind == "empirical":
            if "path" in d:
                p = Path(d["path"])
                if base_dir is not None and not p.is_absolute():
                    p = base_dir / p
                if not p.exists():
                    raise ValueError(f"{where}.path: file not found: {p}")
                text = p.read_text()
                raw_vals = json.loads(text) if text.lstrip().startswith("[") else text.split()
            else:
                raw_vals = d.get("values")
            if not isinstance(raw_vals, list) or not raw_vals:
                raise ValueError(f"{where}.values must be a non-empty list (or give path)")
            try:
                values = tuple(int(float(v)) for v in raw_vals)
            except (TypeError, ValueError):
                raise ValueError(f"{where}.values must be numbers") from None
            if min(values) < 1:
                raise ValueError(f"{where}.values must be >= 1, got {min(values)}")
        return cls(kind, params, lo, hi, tuple(comps), values)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"dist": self.kind, "min": self.min, "max": self.max}
        if self.kind == "quantiles":
            d["points"] = {float(k[1:]): v for k, v in self.params.items()}
        else:
            d.update(self.params)
        if self.kind == "mixture":
            d["components"] = [{"weight": w, **c.to_dict()} for w, c in self.components]
        if self.kind == "empirical":
            d["values"] = list(self.values)
        return d

    # ---- sampling -----------------------------------------------------------------
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(np.rint(self._raw(rng, n)), self.min, self.max).astype(np.int64)

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = self.params
        if self.kind == "fixed":
            return np.full(n, p["value"])
        if self.kind == "uniform":
            return rng.uniform(p["low"], p["high"], n)
        if self.kind == "normal":
            return rng.normal(p["mean"], p["std"], n)
        if self.kind == "lognormal":
            return p["median"] * np.exp(p["sigma"] * rng.standard_normal(n))
        if self.kind == "quantiles":
            qs = np.array([float(k[1:]) for k in p])
            logv = np.log(np.array(list(p.values())))
            return np.exp(np.interp(rng.uniform(0, 1, n), qs, logv))
        if self.kind == "empirical":
            return rng.choice(np.array(self.values, dtype=float), n)
        # mixture: pick a component per sample, then sample each component in bulk
        w = np.array([c[0] for c in self.components])
        pick = rng.choice(len(w), n, p=w / w.sum())
        out = np.empty(n)
        for i, (_, comp) in enumerate(self.components):
            idx = np.flatnonzero(pick == i)
            out[idx] = comp.sample(rng, len(idx))
        return out

    def scaled(self, f: float) -> "LengthDist":
        """All lengths multiplied by f (shape params such as sigma are unitless and kept)."""
        if f == 1.0:
            return self
        keys = {"value", "low", "high", "mean", "std", "median"}
        params = {k: (v * f if (k in keys or self.kind == "quantiles") else v) for k, v in self.params.items()}
        return replace(
            self,
            params=params,
            min=max(1, round(self.min * f)),
            max=max(1, round(self.max * f)),
            components=tuple((w, c.scaled(f)) for w, c in self.components),
            values=tuple(max(1, round(v * f)) for v in self.values),
        )
