"""Latency statistics with bootstrap confidence intervals, SLOs and goodput.

Definitions follow `vllm bench serve`: TTFT = first output chunk - send; TPOT =
(E2E - TTFT) / (output_tokens - 1) per request; ITL = gaps between output chunks (pooled);
E2E = last byte - send. The *_intended variants count from the scheduled send time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from quantpipe.runtime.bench.records import RequestRecord

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
METRICS = ("ttft", "tpot", "itl", "e2e", "ttft_intended", "e2e_intended")
BOOT_B = 200  # resamples; CI endpoints are stable to a few % at this count
BOOT_MAX_N = 20_000  # larger samples are subsampled for the CI (makes CIs conservative)


def pct_key(p: float) -> str:
    return f"p{p:g}"


def metric_values(records: list[RequestRecord], metric: str) -> np.ndarray:
    ok = [r for r in records if r.ok]
    if metric == "itl":
        return np.array([x for r in ok for x in r.itls], dtype=float)
    vals = [getattr(r, metric) for r in ok]
    return np.array([v for v in vals if v is not None], dtype=float)


def stat(x: np.ndarray, which: str) -> float:
    return float(np.mean(x)) if which == "mean" else float(np.percentile(x, float(which[1:])))


def bootstrap(x: np.ndarray, seed: int = 0, conf: float = 0.95) -> dict:
    """{mean, p50, ...}: each {value, lo, hi}; lo/hi is a percentile-bootstrap CI."""
    if len(x) == 0:
        return {}
    rng = np.random.default_rng(seed)
    xs = x if len(x) <= BOOT_MAX_N else rng.choice(x, BOOT_MAX_N, replace=False)
    idx = rng.integers(0, len(xs), (BOOT_B, len(xs)))
    samples = xs[idx]
    qs = np.percentile(samples, PERCENTILES, axis=1)  # (len(PERCENTILES), B)
    means = samples.mean(axis=1)
    a = (1 - conf) / 2 * 100
    out = {"mean": {"value": float(x.mean()), "lo": float(np.percentile(means, a)),
                    "hi": float(np.percentile(means, 100 - a))}}
    for p, row in zip(PERCENTILES, qs):
        out[pct_key(p)] = {"value": float(np.percentile(x, p)), "lo": float(np.percentile(row, a)),
                           "hi": float(np.percentile(row, 100 - a))}
    return out


# ---- SLOs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    metric: str  # ttft | tpot | itl | e2e (or *_intended)
    stat: str  # p99, p50, mean, ...
    limit_s: float

    def __str__(self) -> str:
        return f"{self.metric}_{self.stat}<={self.limit_s * 1000:g}ms"


def parse_slos(text: str | None) -> list[SLO]:
    """'ttft_p99=2s,tpot_p99=100ms' -> SLOs. Units: s, ms, us (default s)."""
    out = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"([a-z0-9_]+?)_(p\d+(?:\.\d+)?|mean)\s*=\s*([\d.]+)\s*(ms|s|us)?", part)
        if not m or m.group(1) not in METRICS:
            raise ValueError(f"bad SLO {part!r}; expected e.g. ttft_p99=2s or tpot_p50=100ms "
                             f"with metric in {', '.join(METRICS)}")
        scale = {"ms": 1e-3, "us": 1e-6, "s": 1.0, None: 1.0}[m.group(4)]
        out.append(SLO(m.group(1), m.group(2), float(m.group(3)) * scale))
    return out


def request_meets(r: RequestRecord, slos: list[SLO]) -> bool:
    """Per-request goodput test: every SLO's limit applied to this request's own value
    (mean ITL for itl), as vLLM's --goodput does."""
    if not r.ok:
        return False
    for s in slos:
        if s.metric == "itl":
            v = float(np.mean(r.itls)) if r.itls else None
        else:
            v = getattr(r, s.metric)
        if v is not None and v > s.limit_s:
            return False
    return True


def summarize(records: list[RequestRecord], slos: list[SLO] | None = None,
              target_rate: float | None = None, seed: int = 0) -> dict:
    """Stage summary: counts, rates, throughput, latency stats with CIs, SLO verdicts."""
    slos = slos or []
    n = len(records)
    ok = [r for r in records if r.ok]
    sends = [r.actual_send for r in records]
    ends = [r.end for r in records if r.end is not None]
    span = (max(ends) - min(sends)) if ends and sends else 0.0
    send_span = (max(sends) - min(sends)) if len(sends) > 1 else 0.0
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = "timeout" if r.timed_out else (str(r.status) if r.status and r.status != 200 else "client")
            errors[key] = errors.get(key, 0) + 1
    lag = np.array([r.schedule_lag for r in records]) if records else np.zeros(0)
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    s = {
        "requests": n, "completed": len(ok), "failed": n - len(ok), "errors": errors,
        "error_rate": (n - len(ok)) / n if n else 0.0,
        "timeout_rate": sum(r.timed_out for r in records) / n if n else 0.0,
        "duration_s": span,
        "target_rate": target_rate,
        # (n-1)/span: the rate of an arrival process, not biased by the last gap
        "achieved_send_rate": (n - 1) / send_span if send_span > 0 else None,
        "request_throughput": len(ok) / span if span > 0 else 0.0,
        "output_token_throughput": out_tok / span if span > 0 else 0.0,
        "total_token_throughput": (out_tok + in_tok) / span if span > 0 else 0.0,
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "schedule_lag": ({"p50": float(np.percentile(lag, 50)), "p99": float(np.percentile(lag, 99)),
                          "max": float(lag.max())} if n else {}),
        "metrics": {m: bootstrap(metric_values(records, m), seed) for m in METRICS},
    }
    if slos:
        good = sum(request_meets(r, slos) for r in records)
        s["goodput"] = good / span if span > 0 else 0.0
        s["slo"] = {str(x): _slo_check(s["metrics"], x) for x in slos}
        s["slo_met"] = all(v["met"] for v in s["slo"].values()) and s["error_rate"] <= 0.01
    return s


def _slo_check(metrics: dict, slo: SLO) -> dict:
    st = metrics.get(slo.metric, {}).get(slo.stat)
    if not st:
        return {"value": None, "limit": slo.limit_s, "met": False}
    return {"value": st["value"], "limit": slo.limit_s, "met": st["value"] <= slo.limit_s}
