"""The eval's quality pass with consecutive texts through each layer together against one
text per call, side by side in one process (alternating, so both see the same machine
state): seconds per pass, and whether every per-token number is the same.

    .venv/bin/python -m benchmarks.bench_score_batching --calib calib_sets/sample-set \
        --candidate ARTIFACT [--candidate ...] [--model gemma3-270m] [--max-texts 64] \
        [--max-tokens 256] [--max-rows 2048] [--repeats 3]

The texts are the ones `quantpipe eval` scores: the seeded subset of the set's held-out
texts (seed 0), each cut to --max-tokens. Every model is float32, as the eval loads it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from quantpipe.eval.scorer import MAX_ROWS, score_many
from quantpipe.eval.stage import load_heldout
from quantpipe.runtime.model.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", required=True, help="a quantpipe calibrate set: its held-out texts are scored")
    ap.add_argument("--candidate", action="append", required=True, help="an artifact (repeatable)")
    ap.add_argument("--model", default=None, help="the baseline [default: the default model]")
    ap.add_argument("--max-texts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-rows", type=int, default=MAX_ROWS)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base, _, tok = load_model(args.model, torch.float32)
    cands = [load_model(c, torch.float32)[0] for c in args.candidate]
    texts = [r["text"] for r in load_heldout(args.calib, args.max_texts, 0)[0]]
    times: dict[int, list[float]] = {1: [], args.max_rows: []}
    results = {}
    for _ in range(args.repeats):
        for rows in times:
            t = time.perf_counter()
            results[rows] = score_many(base, cands, tok, texts, max_tokens=args.max_tokens, max_rows=rows)
            times[rows].append(time.perf_counter() - t)
    same = all(np.array_equal(getattr(x, k), getattr(y, k))
               for a, b in zip(results[1], results[args.max_rows]) for x, y in zip(a.texts, b.texts)
               for k in ("nll_base", "nll_cand", "kl", "agree", "top5_miss"))
    tokens = sum(len(t.kl) + 1 for t in results[1][0].texts)
    print(f"{len(texts)} texts, {tokens} tokens, baseline + {len(cands)} candidate(s), "
          f"{torch.get_num_threads()} thread(s)")
    for rows, ts in times.items():
        print(f"max_rows {rows}: median {statistics.median(ts):.1f} s (range {min(ts):.1f}-{max(ts):.1f})")
    print(f"ratio: {statistics.median(times[args.max_rows]) / statistics.median(times[1]):.2f}; "
          f"every per-token number identical: {same}")


if __name__ == "__main__":
    main()
