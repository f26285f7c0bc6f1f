"""The eval of 3 candidates in this process and on a local Ray cluster of 1 and 2 workers.

    .venv/bin/python benchmarks/bench_ray_eval.py [--suite evals/suites/ci.yaml] [--workers 1,2]

Makes three RTN candidates of the default model (W8A16, W4A16 g64, W4A16 g32) and the
sample log's calibration set, then times `quantpipe eval --quality-only` on them:
sequentially in one process, then with `--ray` on a cluster started here for each worker
count (`ray start --head` on 127.0.0.1 with one CPU, plus one more one-CPU node per extra
worker) and stopped after. Every Ray report's numbers are checked against the sequential
one's. Prints one JSON line per run: wall time, the report's quality phase, the shards.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
ENV = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_USAGE_STATS_ENABLED": "0"}


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, env=ENV, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(workers: int) -> str:
    port = _free_port()
    common = ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", str(500 << 20), "--disable-usage-stats"]
    _run([f"{BIN}/ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
          "--include-dashboard", "false", *common])
    for _ in range(workers - 1):
        _run([f"{BIN}/ray", "start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1", *common])
    return f"127.0.0.1:{port}"


def numbers(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("time_s", "ray", "code_version")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default=os.path.join(ROOT, "evals", "suites", "ci.yaml"))
    ap.add_argument("--workers", default="1,2", help="Ray worker counts, comma-separated")
    args = ap.parse_args()
    qp = f"{BIN}/quantpipe"
    with tempfile.TemporaryDirectory() as tmp:
        calib = os.path.join(tmp, "set")
        _run([qp, "calibrate", "--recipe", "calib_sets/recipes/sample.yaml", "--out", calib, "--no-progress"], cwd=ROOT)
        cands = []
        for name, flags in (("w8a16", ["--scheme", "W8A16"]), ("w4a16-g64", ["--scheme", "W4A16", "--group-size", "64"]),
                            ("w4a16-g32", ["--scheme", "W4A16", "--group-size", "32"])):
            cands.append(os.path.join(tmp, name))
            _run([qp, "quantize", *flags, "--out", cands[-1]])
        base = [qp, "eval", *sum((["--candidate", c] for c in cands), []), "--calib", calib, "--suite", args.suite,
                "--quality-only"]
        runs = [("sequential", None)] + [(f"ray, {w} worker(s)", int(w)) for w in args.workers.split(",")]
        reference = None
        for label, workers in runs:
            out = os.path.join(tmp, f"report-{workers or 0}")
            address = start_cluster(workers) if workers else None
            try:
                t0 = time.perf_counter()
                _run(base + ["--out", out] + (["--ray", address] if address else []))
                wall = time.perf_counter() - t0
            finally:
                if address:
                    _run([f"{BIN}/ray", "stop", "--force"])
            report = json.load(open(os.path.join(out, "report.json")))
            reference = reference or numbers(report)
            print(json.dumps({"run": label, "wall_s": round(wall, 1), "quality_s": report["time_s"].get("quality_s"),
                              "shards": (report.get("ray") or {}).get("texts_per_shard"),
                              "same_numbers_as_sequential": numbers(report) == reference}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
