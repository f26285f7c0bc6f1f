"""Prometheus metrics, vLLM-style names under the `quantpipe:` prefix.

Each server owns a CollectorRegistry, so two servers in one process (tests) never
share counters. prometheus_client metrics are thread-safe: the engine thread updates
engine-side gauges/counters after every step, the event loop counts rejections.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from quantpipe.runtime.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_ITER_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

REJECT_REASONS = ("queue", "rate_limit", "auth", "bad_request")


class ServerMetrics:
    def __init__(self, model_name: str):
        disable_created_metrics()  # the *_created series only double the scrape size
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)  # process_resident_memory_bytes, cpu seconds, fds
        PlatformCollector(registry=reg)
        m = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(f"quantpipe:{name}", doc, m, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(f"quantpipe:{name}", doc, m, registry=reg).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(f"quantpipe:{name}", doc, m, buckets=buckets, registry=reg).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests admitted but waiting (engine queue + hand-off).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.kv_blocks_used = gauge("kv_cache_blocks_used", "KV cache blocks in use.")
        self.kv_blocks_total = gauge("kv_cache_blocks_total", "KV cache blocks in the pool.")
        self.kv_bytes_used = gauge("kv_cache_bytes_used", "Bytes of KV cache in use.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefill).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.aborted = counter("request_aborted", "Requests aborted: client went away or shutdown cut them off.")
        self.timeouts = counter("request_timeout", "Requests aborted for running past --request-timeout.")
        self._success = Counter("quantpipe:request_success", "Requests finished.", m + ["finished_reason"],
                                registry=reg)
        self._rejected = Counter("quantpipe:request_rejected", "Requests refused before admission.",
                                 m + ["reason"], registry=reg)
        for r in ("stop", "length"):
            self._success.labels(model_name, r)
        for r in REJECT_REASONS:
            self._rejected.labels(model_name, r)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean gap between output tokens.", _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.",
                                 _LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS)
        self.request_log_lines = counter("request_log_lines", "Lines written to the request log.")
        self.request_log_dropped = counter("request_log_dropped",
                                           "Request log lines dropped (writer behind, disk full or failing).")
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per engine step.", _ITER_BUCKETS)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def finished(self, out: RequestOutput) -> None:
        """Latency histograms and the success counter for one request that ended normally."""
        c, t = out.outputs[0], out.metrics
        self._success.labels(self.model_name, c.finish_reason or "unknown").inc()
        if t.finish_time is None:
            return
        self.e2e.observe(max(0.0, t.finish_time - t.arrival_time))
        if t.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, t.first_scheduled_time - t.arrival_time))
        if t.first_token_time is not None:
            self.ttft.observe(max(0.0, t.first_token_time - t.arrival_time))
            decode = max(0.0, t.finish_time - t.first_token_time)
            self.decode_time.observe(decode)
            if t.first_scheduled_time is not None:
                self.prefill_time.observe(max(0.0, t.first_token_time - t.first_scheduled_time))
            if len(c.token_ids) > 1:
                self.tpot.observe(decode / (len(c.token_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
