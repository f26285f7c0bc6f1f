"""Stages, the automatic sweep, knee detection, soak and capacity answers.

Sweep: baseline (one request at a time) -> open-loop ramp starting at half the
single-stream rate and growing x`growth` until a level saturates -> extra levels just
below the measured plateau -> knee -> optional soak below the knee.

A level is *saturated* when completions cannot keep up with sends (throughput <
`keep_up` x achieved send rate) or errors exceed `max_error_rate`. The knee is the
highest-throughput unsaturated level: past it throughput stops rising and latency climbs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from quantpipe.runtime.bench.metrics import SLO, summarize
from quantpipe.runtime.bench.results import BenchResult, Stage, summarize_signals
from quantpipe.runtime.bench.runner import Runner
from quantpipe.runtime.bench.scrape import Scraper
from quantpipe.runtime.workload.materialize import Request, materialize
from quantpipe.runtime.workload.spec import WorkloadSpec


@dataclass
class SweepConfig:
    stage_duration_s: float = 30.0
    min_stage_requests: int = 20
    max_stage_requests: int = 5000
    baseline_requests: int = 10
    growth: float = 2.0
    max_levels: int = 10
    refine: tuple[float, ...] = (0.8, 0.9, 0.95)  # extra levels as fractions of the plateau
    keep_up: float = 0.9
    max_error_rate: float = 0.05
    soak_duration_s: float = 0.0  # 0 = no soak
    soak_fraction: float = 0.7  # soak rate as a fraction of the knee rate
    warmup_fraction: float = 0.1  # soak start excluded from drift checks
    headroom: float = 0.35
    target_peak: float | None = None  # req/s to provision for (default: diurnal peak)
    max_concurrency: int | None = None  # client-side cap on in-flight requests
    pool_size: int = 512  # distinct prompts reused across stages


class Bench:
    """Runs stages against one server, keeping every record in `result` as it goes."""

    def __init__(self, runner: Runner, scraper: Scraper | None, spec: WorkloadSpec, tokenizer,
                 slos: list[SLO], cfg: SweepConfig, result: BenchResult,
                 progress: Callable[[str, int], Callable] | None = None):
        self.runner, self.scraper, self.spec, self.tok = runner, scraper, spec, tokenizer
        self.slos, self.cfg, self.result = slos, cfg, result
        self.progress = progress  # (stage name, total) -> per-record callback
        self._pool: list[Request] | None = None

    # ---- requests for a stage -------------------------------------------------------
    def requests_at(self, rate: float | None, n: int, seed: int) -> list[Request]:
        """n requests at `rate` with the workload's arrival shape.

        Without sessions, prompts come from a pool materialized once (tokenizing per stage
        would cost server round trips); arrival times are drawn fresh per stage.
        """
        spec = self.spec if rate is None else self.spec.with_rate(rate)
        spec = replace(spec, num_requests=n, duration_s=None)
        if spec.sessions or spec.arrival.process == "trace":
            return materialize(spec, self.tok, seed=seed)
        if self._pool is None:
            self._pool = materialize(replace(self.spec, num_requests=min(self.cfg.pool_size, max(n, 64)),
                                             duration_s=None, sessions=None), self.tok)
        times = spec.arrival.sample(np.random.default_rng(seed), n, None)
        return [Request(replace(self._pool[i % len(self._pool)].spec, index=i, arrival_s=float(t)),
                        self._pool[i % len(self._pool)].prompt, self._pool[i % len(self._pool)].prompt_ids,
                        self._pool[i % len(self._pool)].tokenizer_source) for i, t in enumerate(times)]

    # ---- one stage ---------------------------------------------------------------------
    async def stage(self, name: str, reqs: list[Request], *, rate: float | None = None,
                    concurrency: int | None = None) -> Stage:
        st = Stage(name, "closed" if concurrency else "open", target_rate=rate, concurrency=concurrency)
        self.result.stages.append(st)
        self.runner.on_done = self.progress(name, len(reqs)) if self.progress else None
        st.t_start = self.runner.now()
        before = len(self.runner.records)
        try:
            if concurrency:
                await self.runner.closed_loop(reqs, concurrency, name)
            else:
                await self.runner.open_loop(reqs, name, self.cfg.max_concurrency)
        finally:
            st.records = self.runner.records[before:]
            st.t_end = self.runner.now()
            self.finish(st)
        return st

    def finish(self, st: Stage) -> None:
        st.summary = summarize(st.records, self.slos, st.target_rate)
        if self.scraper:
            st.signals = summarize_signals(self.scraper.window(st.t_start, st.t_end))
        s = st.summary
        send = s["achieved_send_rate"] or 0.0
        st.saturated = bool(s["error_rate"] > self.cfg.max_error_rate
                            or (st.mode == "open" and send > 0 and s["request_throughput"] < self.cfg.keep_up * send))

    def _n(self, rate: float) -> int:
        c = self.cfg
        return int(min(c.max_stage_requests, max(c.min_stage_requests, round(rate * c.stage_duration_s))))

    # ---- sweep -------------------------------------------------------------------------
    async def sweep(self) -> None:
        c = self.cfg
        base = await self.stage("baseline", self.requests_at(None, c.baseline_requests, 1), concurrency=1)
        e2e = base.summary["metrics"]["e2e"].get("mean", {}).get("value")
        if not e2e:
            raise RuntimeError("baseline produced no successful request; see errors in the output")
        rate = 0.5 / e2e
        last_ok: Stage | None = None
        sat: Stage | None = None
        for lvl in range(c.max_levels):
            st = await self.stage(f"rate={rate:.3g}", self.requests_at(rate, self._n(rate), 100 + lvl), rate=rate)
            if st.saturated:
                sat = st
                break
            last_ok = st
            rate *= c.growth
        if sat is not None:
            plateau = max(s.summary["request_throughput"] for s in self.result.stages if s.mode == "open")
            lo = last_ok.target_rate if last_ok else 0.0
            for k, f in enumerate(c.refine):
                r = f * plateau
                if lo < r < sat.target_rate:
                    await self.stage(f"rate={r:.3g}", self.requests_at(r, self._n(r), 200 + k), rate=r)
        self.result.knee = find_knee(self.result.stages, base)
        self.result.capacity = capacity(self.result.stages, self.result.knee, self.slos, c.headroom,
                                        c.target_peak or self._diurnal_peak())
        if c.soak_duration_s > 0 and self.result.knee:
            await self.soak(self.result.knee["rate"] * c.soak_fraction)

    def _diurnal_peak(self) -> float | None:
        a = self.spec.arrival
        return a.peak_rate() if a.process == "diurnal" else None

    async def soak(self, rate: float) -> None:
        c = self.cfg
        n = int(min(c.max_stage_requests * 4, max(c.min_stage_requests, rate * c.soak_duration_s)))
        st = await self.stage(f"soak@{rate:.3g}", self.requests_at(rate, n, 300), rate=rate)
        series = self.scraper.window(st.t_start, st.t_end) if self.scraper else []
        self.result.soak = drift(st, series, c.warmup_fraction)


# ---- analysis -----------------------------------------------------------------------------
def _p99(st: Stage, metric: str = "e2e") -> float | None:
    return st.summary["metrics"].get(metric, {}).get("p99", {}).get("value")


def explain(st: Stage) -> str:
    """Which server signal explains saturation at this stage."""
    sig = st.signals
    if not sig:
        return "unknown (server exposes no quantpipe:/vllm: metrics)"
    if sig.get("kv_cache_usage_perc", {}).get("max", 0) >= 0.9:
        return "KV cache full"
    pre = sig.get("num_preemptions_total")
    if pre and pre["last"] > pre["first"]:
        return "preemptions"
    w = sig.get("num_requests_waiting")
    if w and w["max"] >= 1 and (w["slope_per_s"] > 0 or w["mean"] >= 1):
        return "queue growing (requests waiting for a slot)"
    return "none (no server-side signal: check client or network)"


def find_knee(stages: list[Stage], baseline: Stage | None) -> dict | None:
    ramp = sorted((s for s in stages if s.mode == "open" and s.target_rate and not s.name.startswith("soak")),
                  key=lambda s: s.target_rate)
    if not ramp:
        return None
    ok = [s for s in ramp if not s.saturated]
    sat = [s for s in ramp if s.saturated]
    knee = max(ok, key=lambda s: s.summary["request_throughput"]) if ok else ramp[0]
    beyond = min(sat, key=lambda s: s.target_rate) if sat else None
    b99 = _p99(baseline) if baseline else None
    k99 = _p99(knee)
    return {
        # Knee throughput = the plateau (best completion rate seen at any level): it is where
        # throughput stops rising, and it is less noisy than any single short stage.
        "stage": knee.name, "rate": knee.target_rate, "stage_throughput": knee.summary["request_throughput"],
        "throughput": max(s.summary["request_throughput"] for s in ramp),
        "plateau_throughput": max(s.summary["request_throughput"] for s in ramp),
        "e2e_p99": k99, "baseline_e2e_p99": b99,
        "latency_climb": (k99 / b99) if (k99 and b99) else None,
        "saturated_stage": beyond.name if beyond else None,
        "explanation": explain(beyond or knee) if beyond else "not reached: no level saturated",
        "found": beyond is not None,
    }


def capacity(stages: list[Stage], knee: dict | None, slos: list[SLO], headroom: float,
             target_peak: float | None) -> dict | None:
    """Highest tested rate meeting the SLOs (or the knee without SLOs), minus headroom."""
    if knee is None:
        return None
    ramp = [s for s in stages if s.mode == "open" and s.target_rate and not s.saturated
            and not s.name.startswith("soak")]
    if slos:
        good = [s for s in ramp if _meets(s, slos)]
        best = max(good, key=lambda s: s.summary["request_throughput"]) if good else None
        basis = "highest level meeting SLOs " + ", ".join(map(str, slos))
    else:
        best = next((s for s in ramp if s.name == knee["stage"]), None)
        basis = "knee (no SLOs given)"
    if best is None:
        return {"max_rate": 0.0, "recommended_rate": 0.0, "headroom": headroom, "basis": basis,
                "note": "no tested level met the SLOs", "replicas": None, "target_peak": target_peak}
    cap = min(best.summary["request_throughput"], best.target_rate)
    rec = cap * (1 - headroom)
    return {"max_rate": cap, "stage": best.name, "recommended_rate": rec, "headroom": headroom, "basis": basis,
            "target_peak": target_peak,
            "replicas": math.ceil(target_peak / rec) if (target_peak and rec > 0) else None}


def _meets(st: Stage, slos: list[SLO]) -> bool:
    """All SLOs met at this stage (checked here, so capacity can be asked for other SLOs)."""
    m = st.summary["metrics"]
    for slo in slos:
        v = m.get(slo.metric, {}).get(slo.stat, {}).get("value")
        if v is None or v > slo.limit_s:
            return False
    return st.summary["error_rate"] <= 0.01


MEMORY_GROWTH_MIN_BYTES = 64 * 2**20
MEMORY_GROWTH_FRACTION = 0.10


def _growth(series: list[tuple[float, dict]], name: str, t0: float) -> tuple[float, float] | None:
    """(growth over the window from a least-squares line, first value) of one metric after t0."""
    pts = [(t, v[name]) for t, v in series if t >= t0 and name in v]
    if len(pts) < 3:
        return None
    slope = float(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0])
    return slope * (pts[-1][0] - pts[0][0]), pts[0][1]


def drift(st: Stage, series: list[tuple[float, dict]], warmup_fraction: float, windows: int = 5) -> dict:
    """Compare the soak's early and late windows (after warm-up) for creeping latency,
    growing KV/memory use and rising errors."""
    recs = sorted(st.records, key=lambda r: r.intended_send)
    if len(recs) < windows * 5:
        return {"verdict": "too few requests to judge drift", "issues": []}
    t0 = st.t_start + (st.t_end - st.t_start) * warmup_fraction
    kept = [r for r in recs if r.intended_send >= t0]
    chunks = np.array_split(np.arange(len(kept)), windows)
    rows = []
    for idx in chunks:
        part = [kept[i] for i in idx]
        e2e = [r.e2e for r in part if r.ok and r.e2e is not None]
        rows.append({"t": part[0].intended_send, "n": len(part),
                     "e2e_p99": float(np.percentile(e2e, 99)) if e2e else None,
                     "error_rate": sum(not r.ok for r in part) / len(part)})
    issues = []
    first, last = rows[0], rows[-1]
    if first["e2e_p99"] and last["e2e_p99"] and last["e2e_p99"] > 1.5 * first["e2e_p99"]:
        issues.append(f"P99 creep: e2e p99 {first['e2e_p99'] * 1000:.0f}ms -> {last['e2e_p99'] * 1000:.0f}ms")
    if last["error_rate"] > first["error_rate"] + 0.02:
        issues.append(f"rising errors: {first['error_rate']:.1%} -> {last['error_rate']:.1%}")
    kv = _growth(series, "kv_cache_usage_perc", t0)
    if kv is not None and kv[0] > 0.2:
        issues.append(f"KV usage growing: +{kv[0]:.0%} over the soak")
    mem = _growth(series, "process_resident_memory_bytes", t0)
    # Allocators and caches settle in steps; only steady growth past both bounds is a leak.
    if mem is not None and mem[0] > max(MEMORY_GROWTH_MIN_BYTES, MEMORY_GROWTH_FRACTION * mem[1]):
        issues.append(f"server memory growing: +{mem[0] / 2**20:.0f} MiB over the soak "
                      f"(from {mem[1] / 2**20:.0f} MiB)")
    return {"rate": st.target_rate, "windows": rows, "issues": issues,
            "verdict": "stable" if not issues else "drift: " + "; ".join(issues)}
