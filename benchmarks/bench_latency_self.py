"""The default gate's latency rules on A/Bs whose answer is known: a model served against
itself (should pass) and, with --candidate, against another model or artifact.

Each seed draws other held-out prompts; every A/B is the eval's own procedure
(quantpipe.eval.latency.measure: an untimed pass per server, then alternating repeats)
judged by the default policy's latency rules. Prints one line per seed and the count that
passed.

    .venv/bin/python benchmarks/bench_latency_self.py --calib calib_sets/sample-set --seeds 20 --repeats 8
    .venv/bin/python benchmarks/bench_latency_self.py --calib calib_sets/sample-set --requests 32 \\
        --max-output-tokens 64 --repeats 8 --seeds 5              # the default suite's workload
    .venv/bin/python benchmarks/bench_latency_self.py --calib calib_sets/sample-set --half-cpus --seeds 3
                                                      # the second server on half the CPUs: should fail
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib", required=True, help="a calibration set (its heldout.jsonl)")
    ap.add_argument("--candidate", default=None, help="serve this instead of a second copy of the baseline")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-output-tokens", type=int, default=8)
    ap.add_argument("--half-cpus", action="store_true", help="serve the second side on half the CPUs (Linux)")
    args = ap.parse_args()

    from quantpipe.eval.latency import KV_CACHE_MEMORY, compare, measure, workload
    from quantpipe.eval.stage import load_heldout
    from quantpipe.gate import DEFAULT_POLICY, judge, load_policy
    from quantpipe.runtime.model.tokenizer import load_tokenizer
    from quantpipe.runtime.server.process import Served, split_cpus

    cfg = {"repeats": args.repeats, "requests": args.requests, "concurrency": args.concurrency,
           "max_output_tokens": args.max_output_tokens, "rate": None}
    rules = [r for r in load_policy(str(DEFAULT_POLICY))[0] if r.section == "latency"]
    rows, _ = load_heldout(args.calib, 100_000, 0)
    tokenizer = load_tokenizer(None)
    extra = ["--kv-cache-memory", KV_CACHE_MEMORY]
    passed = 0
    cpus = split_cpus(2)[0] if args.half_cpus else None
    if args.half_cpus and cpus is None:
        raise SystemExit("--half-cpus needs at least 2 CPUs")
    with Served(None, 2048, extra) as a, Served(args.candidate, 2048, extra, cpus=cpus) as b:
        for seed in range(args.seeds):
            pick = np.random.default_rng(seed).choice(len(rows), min(args.requests, len(rows)), replace=False)
            reqs = workload([rows[i] for i in pick], tokenizer, args.requests, args.max_output_tokens, 2048)
            t = time.perf_counter()
            runs = measure([a.url, b.url], reqs, cfg)["concurrency"]
            section = compare(runs[0], runs[1])
            judged = judge({"scope": "latency"}, {"latency": section}, rules)
            ok = all(r["result"] == "pass" for r in judged)
            passed += ok
            cells = "  ".join(f"{r['metric'].removeprefix('latency.')} {r['compare']} {r.get('value', float('nan')):.3f}"
                              f" ({r['result']})" for r in judged)
            spread = section["ttft_p99_ratio"]
            print(f"seed {seed:2d} {time.perf_counter() - t:5.1f} s  {cells}  ttft_p99 per repeat "
                  f"{spread['min']:.3f}-{spread['max']:.3f}", flush=True)
    against = "itself" if args.candidate is None else args.candidate
    print(f"passed {passed} of {args.seeds} (baseline against {against}{' on half the CPUs' if cpus else ''}; "
          f"{args.requests} requests x {args.max_output_tokens} tokens at {args.concurrency} in flight, "
          f"{args.repeats} repeats)")


if __name__ == "__main__":
    main()
