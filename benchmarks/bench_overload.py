"""Overload latency: how fast a full server says 429, and whether /health stays live.

    .venv/bin/python -m benchmarks.bench_overload [--repeats 5] [--requests 200]

Starts a real server (float32, --max-queued-requests 16), then per repeat writes
--requests completions (8 tokens each) at once on pre-opened connections while a
separate thread polls /health, the same probe as the overload test. Reports, as medians
over repeats: the slowest 429's latency, the median 429's, the slowest /health poll, and
the median admitted request's latency (the compute the 429s do not wait for).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from tests.server.conftest import ServerProcess
from tests.server.overload import burst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    body = {"prompt": "The three primary colors are", "max_tokens": 8, "temperature": 0}
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "128MiB",
                               "--max-queued-requests", "16", log_path=f"{tmp}/server.log").wait_ready()
        try:
            rows = []
            for _ in range(args.repeats):
                results, health = burst(server, body, args.requests)
                shed = sorted(t for s, *_, t in results if s == 429)
                served = [t for s, *_, t in results if s == 200]
                rows.append({"rejected": len(shed), "admitted": len(served), "max_429_s": shed[-1],
                             "median_429_s": statistics.median(shed), "max_health_s": max(health),
                             "median_admitted_s": statistics.median(served)})
        finally:
            server.stop()
    print(json.dumps({"repeats": rows and len(rows), "requests": args.requests,
                      **{k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}}))


if __name__ == "__main__":
    main()
