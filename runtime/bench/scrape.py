"""Scrape the server's Prometheus /metrics into time series during a run.

Both `quantpipe:` and `vllm:` names are read and normalized to the bare name
(e.g. num_requests_waiting); vLLM's older gpu_cache_usage_perc maps to kv_cache_usage_perc.
Of the unprefixed names, only the standard process_resident_memory_bytes is kept.
Histogram buckets are skipped; samples with several label sets are summed.
"""

from __future__ import annotations

import asyncio
import re
import time

from quantpipe.runtime.bench.http import HTTPClient

PREFIXES = ("quantpipe:", "vllm:")
UNPREFIXED = ("process_resident_memory_bytes",)  # from prometheus_client's process collector
ALIASES = {"gpu_cache_usage_perc": "kv_cache_usage_perc", "cpu_cache_usage_perc": "cpu_kv_cache_usage_perc"}


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue  # comments, blanks
        name = m.group(1)
        prefix = "" if name in UNPREFIXED else next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None or name.endswith("_bucket"):
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        key = ALIASES.get(name[len(prefix):], name[len(prefix):])
        out[key] = out.get(key, 0.0) + value
    return out


class Scraper:
    """Polls /metrics every `interval_s`; `series` is a list of (t, {name: value})."""

    def __init__(self, base_url: str, clock0: float, interval_s: float = 0.5):
        self.client = HTTPClient(base_url, connect_timeout=2.0)
        self.clock0, self.interval_s = clock0, interval_s
        self.series: list[tuple[float, dict[str, float]]] = []
        self.available: bool | None = None  # None until the first scrape answered
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def scrape_once(self) -> None:
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the
            # cancellation stop() sends when the scrape completes at that moment, and the
            # loop then polls forever (it hung a latency A/B once).
            async with asyncio.timeout(2.0):
                resp = await self.client.get("/metrics")
                body = await resp.read()
            if resp.status != 200:
                self.available = self.available or False
                return
            values = parse_prometheus(body.decode("utf-8", "replace"))
            self.available = bool(values) or bool(self.available)
            if values:
                self.series.append((time.perf_counter() - self.clock0, values))
        except Exception:  # noqa: BLE001 - a missed scrape is not a failed run
            self.available = self.available or False

    async def _loop(self) -> None:
        while not self._stopping:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self._stopping = True  # ends the loop even if a cancellation were lost
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await self.client.aclose()

    def window(self, t0: float, t1: float) -> list[tuple[float, dict[str, float]]]:
        return [(t, v) for t, v in self.series if t0 <= t <= t1]
