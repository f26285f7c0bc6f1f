"""Metric definitions, bootstrap CIs, SLOs/goodput, Prometheus parsing, knee/capacity, compare."""

import numpy as np
import pytest

from quantpipe.runtime.bench.compare import compare, diff_ci
from quantpipe.runtime.bench.metrics import bootstrap, parse_slos, request_meets, summarize
from quantpipe.runtime.bench.records import RequestRecord
from quantpipe.runtime.bench.results import BenchResult, Stage
from quantpipe.runtime.bench.scrape import parse_prometheus
from quantpipe.runtime.bench.sweep import capacity, drift, find_knee


def rec(i, send=0.0, ttft=0.1, itl=0.01, n=11, status=200, stage="s", intended=None):
    chunks = [send + ttft + k * itl for k in range(n)]
    return RequestRecord(index=i, stage=stage, intended_send=send if intended is None else intended, actual_send=send,
                         first_token=chunks[0], chunk_times=chunks, end=chunks[-1], output_tokens=n, status=status)


def test_vllm_definitions():
    r = rec(0, send=1.0, ttft=0.2, itl=0.05, n=5, intended=0.9)
    assert r.ttft == pytest.approx(0.2) and r.e2e == pytest.approx(0.4)
    assert r.tpot == pytest.approx(0.05) and r.itls == pytest.approx([0.05] * 4)
    assert r.ttft_intended == pytest.approx(0.3) and r.schedule_lag == pytest.approx(0.1)
    assert rec(1, n=1).tpot is None


def test_bootstrap_ci_brackets_truth():
    x = np.random.default_rng(0).exponential(1.0, 5000)
    b = bootstrap(x)
    assert b["p50"]["lo"] < np.log(2) < b["p50"]["hi"]
    assert b["mean"]["lo"] < 1.0 < b["mean"]["hi"]
    assert b["p99"]["hi"] - b["p99"]["lo"] > b["p50"]["hi"] - b["p50"]["lo"]


def test_slos_and_goodput():
    slos = parse_slos("ttft_p99=150ms, tpot_p99=0.02s")
    assert [str(s) for s in slos] == ["ttft_p99<=150ms", "tpot_p99<=20ms"]
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slos("latency_p99=1s")
    good = [rec(i, send=i * 0.1) for i in range(8)]
    slow = [rec(8, send=0.8, ttft=0.5), rec(9, send=0.9, status=500)]
    assert request_meets(good[0], slos) and not request_meets(slow[0], slos)
    s = summarize(good + slow, slos, target_rate=10)
    assert s["errors"] == {"500": 1} and s["error_rate"] == 0.1
    assert s["goodput"] == pytest.approx(8 / s["duration_s"])
    assert not s["slo_met"]  # ttft p99 over the limit, and 10% errors
    assert s["metrics"]["tpot"]["p50"]["value"] == pytest.approx(0.01)
    assert s["achieved_send_rate"] == pytest.approx(10)


def test_prometheus_parsing_both_prefixes():
    text = ('# HELP x\n# TYPE quantpipe:num_requests_running gauge\n'
            'quantpipe:num_requests_running{model_name="m"} 3\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 2\n'
            'vllm:num_requests_waiting{model_name="m",engine="1"} 5\n'
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
            'vllm:e2e_request_latency_seconds_bucket{le="1"} 9\n'
            'process_cpu_seconds_total 12\n'
            'process_resident_memory_bytes 1.5e+09\n')
    assert parse_prometheus(text) == {"num_requests_running": 3, "num_requests_waiting": 7, "kv_cache_usage_perc": 0.5,
                                      "process_resident_memory_bytes": 1.5e9}


def _stage(name, rate, tput, sat, e2e=0.05, waiting=0.0):
    recs = [rec(i, send=i / rate, ttft=e2e / 2, itl=e2e / 20, n=11) for i in range(50)]
    st = Stage(name, "open", target_rate=rate, records=recs, saturated=sat)
    st.summary = summarize(recs, parse_slos("e2e_p99=200ms"), rate)
    st.summary["request_throughput"] = tput
    st.signals = {"num_requests_waiting": {"first": 0, "last": waiting, "mean": waiting, "max": waiting,
                                           "slope_per_s": waiting}}
    return st


def test_knee_and_capacity_respect_headroom():
    stages = [_stage("r10", 10, 10, False), _stage("r20", 20, 19.8, False), _stage("r40", 40, 36, False, 0.15),
              _stage("r80", 80, 41, True, 0.9, waiting=20)]
    knee = find_knee(stages, None)
    assert knee["stage"] == "r40" and knee["found"] and knee["explanation"].startswith("queue growing")
    cap = capacity(stages, knee, parse_slos("e2e_p99=200ms"), 0.35, target_peak=100)
    assert cap["max_rate"] == 36 and cap["recommended_rate"] == pytest.approx(36 * 0.65)
    assert cap["replicas"] == 5  # ceil(100 / 23.4)
    cap2 = capacity(stages, knee, parse_slos("e2e_p99=100ms"), 0.35, None)
    assert cap2["max_rate"] == 19.8  # r40 misses the tighter SLO


def test_drift_detects_p99_creep():
    recs = [rec(i, send=i * 0.1, ttft=0.05 + (0.5 if i > 150 else 0)) for i in range(200)]
    st = Stage("soak", "open", target_rate=10, records=recs, t_start=0, t_end=20)
    assert "P99 creep" in drift(st, [], 0.1)["verdict"]
    flat = Stage("soak", "open", target_rate=10, records=[rec(i, send=i * 0.1) for i in range(200)], t_start=0, t_end=20)
    series = [(t, {"kv_cache_usage_perc": t / 20}) for t in range(21)]
    out = drift(flat, series, 0.1)
    assert out["issues"] == ["KV usage growing: +90% over the soak"]


def test_drift_flags_steady_memory_growth_not_noise():
    flat = Stage("soak", "open", target_rate=10, records=[rec(i, send=i * 0.1) for i in range(200)], t_start=0, t_end=20)
    mib = 2**20
    leak = [(t, {"process_resident_memory_bytes": 1000 * mib + t * 10 * mib}) for t in range(21)]
    assert drift(flat, leak, 0.1)["issues"] == ["server memory growing: +180 MiB over the soak (from 1020 MiB)"]
    # Growth under 10% of the process (here +50 MiB on 1 GiB), or a one-off step, is not a leak.
    small = [(t, {"process_resident_memory_bytes": 1000 * mib + t * 2.5 * mib}) for t in range(21)]
    step = [(t, {"process_resident_memory_bytes": (1000 + (30 if t > 10 else 0)) * mib}) for t in range(21)]
    assert drift(flat, small, 0.1)["verdict"] == "stable"
    assert drift(flat, step, 0.1)["verdict"] == "stable"


def test_compare_verdicts():
    rng = np.random.default_rng(0)
    a = rng.normal(0.1, 0.01, 2000)
    assert diff_ci(a, a * 0.8, "p50")["verdict"] == "better"
    assert diff_ci(a, a * 1.2, "p99")["verdict"] == "worse"
    assert diff_ci(a, rng.normal(0.1, 0.01, 2000), "mean")["verdict"] == "no significant change"
    ra = BenchResult("run", stages=[Stage("run", "open", records=[rec(i, send=i * 0.1, ttft=0.1) for i in range(100)])])
    rb = BenchResult("run", stages=[Stage("run", "open", records=[rec(i, send=i * 0.1, ttft=0.2) for i in range(100)])])
    rows = {r["metric"]: r for r in compare(ra, rb)}
    assert rows["ttft_p50"]["verdict"] == "worse" and rows["itl_p50"]["verdict"] == "no significant change"


def test_scraper_stops_however_a_scrape_and_the_stop_line_up():
    """stop() returns while scrapes are in flight, whatever the moment. With wait_for on
    Python 3.11 a cancellation that meets a completing scrape was swallowed and the scrape
    loop polled forever (a latency A/B hung on it); 300 stops at random moments found it."""
    import asyncio
    import random
    import time

    from quantpipe.runtime.bench.scrape import Scraper

    async def metrics(reader, writer):
        try:
            while await reader.readline():
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                body = b"quantpipe:num_requests_running 1\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass

    async def main():
        server = await asyncio.start_server(metrics, "127.0.0.1", 0)
        url = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
        rng, scraped, hung = random.Random(0), 0, 0
        for _ in range(300):
            scraper = Scraper(url, time.perf_counter(), interval_s=0)
            scraper.start()
            await asyncio.sleep(rng.random() * 0.003)
            stopping = asyncio.ensure_future(scraper.stop())
            done, _ = await asyncio.wait([stopping], timeout=5)
            if not done:
                hung += 1
                while not scraper._task.done():  # end the runaway loop so the test can finish
                    scraper._task.cancel()
                    await asyncio.sleep(0.01)
            scraped += len(scraper.series)
        server.close()
        return hung, scraped

    hung, scraped = asyncio.run(main())
    assert hung == 0, f"{hung} of 300 stops did not return"
    assert scraped > 0  # the scrapes did run while being stopped
