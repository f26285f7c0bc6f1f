"""Can the load generator itself keep up? Open loop at >= 500 req/s against the mock.

Reports achieved send rate vs target and schedule lag (actual - intended send time);
target: P99 lag < 5 ms. The mock runs in its own process, so the generator's event loop
is measured, not the server's.

    .venv/bin/python benchmarks/bench_loadgen.py --rate 500 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from quantpipe.runtime.bench.loop import run_async
from quantpipe.runtime.bench.metrics import summarize
from quantpipe.runtime.bench.mock_server import spawn_mock
from quantpipe.runtime.bench.runner import Runner, Target
from quantpipe.runtime.workload import WorkloadSpec, materialize


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--process", default="poisson", choices=("poisson", "constant"))
    args = p.parse_args()
    n = int(args.rate * args.duration)
    spec = WorkloadSpec.from_dict({"num_requests": n, "prompt_tokens": 32, "output_tokens": args.output_tokens,
                                   "arrival": {"process": args.process, "rate": args.rate}})
    reqs = materialize(spec)
    with spawn_mock(ttft_ms=5, itl_ms=2) as url:
        async def go():
            r = Runner(Target(url, timeout_s=30))
            try:
                await r.preflight()
                return await asyncio.wait_for(r.open_loop(reqs, "loadgen"), args.duration * 3 + 30)
            finally:
                await r.aclose()
        t = time.perf_counter()
        recs = run_async(go())
        wall = time.perf_counter() - t
    s = summarize(recs, target_rate=args.rate)
    lag = s["schedule_lag"]
    # A Poisson schedule's own rate differs from the target by sampling noise; judge against it.
    sched = (n - 1) / reqs[-1].arrival_s
    out = {"target_rate": args.rate, "schedule_rate": round(sched, 1), "achieved_send_rate": round(s["achieved_send_rate"], 1),
           "completed_per_s": round(s["request_throughput"], 1), "requests": n, "failed": s["failed"],
           "output_tokens_per_request": args.output_tokens, "chunks_per_s": round(s["output_token_throughput"]),
           "schedule_lag_ms": {k: round(v * 1000, 3) for k, v in lag.items()}, "wall_s": round(wall, 1)}
    print(json.dumps(out, indent=1))
    ok = s["failed"] == 0 and lag["p99"] < 0.005 and s["achieved_send_rate"] >= 0.97 * sched
    print("PASS" if ok else "FAIL: P99 lag >= 5 ms, rate short, or errors")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
