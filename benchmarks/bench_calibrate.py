"""Calibration sampling at production-log scale: wall time and peak memory.

    .venv/bin/python benchmarks/bench_calibrate.py [--lines 1000000] [--strata metadata.task,length]
    .venv/bin/python benchmarks/bench_calibrate.py --lines 100000 --strata cluster
    .venv/bin/python benchmarks/bench_calibrate.py --keep LOG --files 20 --ray 127.0.0.1:6379

Writes a request log of `--lines` chat requests (~1 KB each, six task labels with skewed
shares, conversations of 1-3 turns; random word sequences from Python's documentation
vocabulary) to a temporary folder, then runs `quantpipe calibrate` on it in a subprocess
and reports its wall time and peak RSS (targets: 1M lines <= 120 s and <= 1 GB with
metadata.task,length; 100k lines with cluster <= 180 s).

`--files N` deals the log's lines round-robin into N files (after writing or reading the
one log) and calibrates on all of them; `--ray ADDRESS` passes the cluster to calibrate,
whose first pass then runs in Ray's worker processes: the memory columns then count the
driver process only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TASKS = {"docs_qa": 0.42, "code": 0.25, "summarize": 0.15, "classify": 0.10, "chitchat": 0.06, "translate": 0.02}


def write_log(path: str, lines: int, seed: int = 0) -> int:
    from tests.calibrate.synth import vocabulary

    vocab = np.array(vocabulary())
    rng = np.random.default_rng(seed)
    tasks = list(TASKS)
    task_of = rng.choice(len(tasks), size=lines, p=list(TASKS.values()))
    conv = 0
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            if rng.random() < 0.5:
                conv += 1
            user = " ".join(vocab[rng.integers(0, len(vocab), rng.integers(60, 120))])
            reply = " ".join(vocab[rng.integers(0, len(vocab), rng.integers(10, 30))])
            meta = {"task": tasks[task_of[i]], "conversation_id": f"c{conv}"}
            f.write(json.dumps({
                "id": f"chatcmpl-{i}", "created": 1.7e9 + i, "endpoint": "/v1/chat/completions",
                "model": "SmolLM2-135M-Instruct", "status": "ok",
                "request": {"messages": [{"role": "user", "content": user}], "max_tokens": 64, "metadata": meta},
                "output": {"text": reply, "finish_reason": "stop"},
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0},
                "timings": {"queue_s": 0.01, "ttft_s": 0.2, "total_s": 1.5}, "metadata": meta}) + "\n")
    return os.path.getsize(path)


def split(log: str, parts: int, folder: str) -> list[str]:
    """The log's lines dealt round-robin into `parts` files."""
    names = [os.path.join(folder, f"part-{k:03d}.jsonl") for k in range(parts)]
    outs = [open(n, "w", encoding="utf-8") for n in names]
    try:
        with open(log, encoding="utf-8") as f:
            for i, line in enumerate(f):
                outs[i % parts].write(line)
    finally:
        for o in outs:
            o.close()
    return names


def _tree_memory(pid: int) -> tuple[int, int]:
    """Resident and proportional (PSS) bytes of `pid` and its children, summed; (0, 0) once gone.

    The RSS sum counts pages the forked workers share with their parent once per process;
    PSS divides each shared page among its sharers, so its sum is the tree's real footprint.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    rss = pss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Rss:", "Pss:")):
                        kib = int(line.split()[1]) * 1024
                        if line[0:3] == "Rss":
                            rss += kib
                        else:
                            pss += kib
        except (OSError, IndexError, ValueError):
            pass
        todo += children.get(p, [])
    return rss, pss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--strata", default="metadata.task,length")
    ap.add_argument("--keep", default=None, help="write the log here and keep it (default: a temporary folder)")
    ap.add_argument("--workers", type=int, default=None, help="passed to quantpipe calibrate (default: its own)")
    ap.add_argument("--files", type=int, default=1, help="split the log into this many files first")
    ap.add_argument("--ray", default=None, help="a Ray cluster's address, passed to quantpipe calibrate")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = args.keep or os.path.join(tmp, "requests.jsonl")
        t0 = time.perf_counter()
        if not os.path.exists(log):
            size = write_log(log, args.lines)
        else:
            size = os.path.getsize(log)
        gen_s = time.perf_counter() - t0
        logs = [log] if args.files == 1 else split(log, args.files, tmp)
        cmd = [os.path.join(os.path.dirname(sys.executable), "quantpipe"), "calibrate", "--logs", ",".join(logs),
               "--strata", args.strata, "--out", os.path.join(tmp, "set"), "--no-progress"]
        if args.workers:
            cmd += ["--workers", str(args.workers)]
        if args.ray:
            cmd += ["--ray", args.ray]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak_sum = peak_pss = 0
        while proc.poll() is None:
            # The first pass runs in worker processes: memory is the whole tree's.
            rss, pss = _tree_memory(proc.pid)
            peak_sum, peak_pss = max(peak_sum, rss), max(peak_pss, pss)
            time.sleep(0.2)
        out, err = proc.communicate()
        wall = time.perf_counter() - t0
        peak_one = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if proc.returncode != 0:
            print(out, err, file=sys.stderr)
            return 1
        print(out.splitlines()[0])
        print(json.dumps({"lines": args.lines, "log_mib": round(size / 2**20), "strata": args.strata,
                          "workers": args.workers or "default", "files": args.files, "ray": args.ray,
                          "generate_s": round(gen_s, 1),
                          "calibrate_wall_s": round(wall, 1), "peak_rss_mib_largest_process": round(peak_one),
                          "peak_rss_mib_all_processes": round(peak_sum / 2**20),
                          "peak_pss_mib_all_processes": round(peak_pss / 2**20)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
