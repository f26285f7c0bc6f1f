"""What one model costs in an eval, part by part, on the default model in float32:
the forward pass over 256-token texts, the per-token statistics (one candidate at a time,
and six candidates sharing the baseline's part, side by side), greedy generation (engine
start included) and multiple choice.

    .venv/bin/python benchmarks/bench_eval_parts.py
"""

from __future__ import annotations

import time

import torch

from quantpipe.eval import generation, mc
from quantpipe.eval.scorer import token_stats, token_stats_many
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model
from quantpipe.runtime.workload.text import corpus_text


def main() -> None:
    model, _, tok = load_model(None, torch.float32)
    ids = tok.encode(corpus_text()[:200000])
    texts = [ids[i * 256:(i + 1) * 256] for i in range(16)]
    t = time.perf_counter()
    logits = [sequence_logits(model, s)[:-1] for s in texts]
    print(f"forward pass, one 256-token text: {(time.perf_counter() - t) / len(texts):.3f} s")
    t = time.perf_counter()
    for s, lg in zip(texts, logits):
        token_stats(lg, lg, s)
    print(f"statistics, one text: {(time.perf_counter() - t) / len(texts):.3f} s")
    six = [[lg + 0.01 * k for k in range(6)] for lg in logits[:4]]
    for _ in range(2):  # alternating, so both see the same machine state
        t = time.perf_counter()
        for s, lg, cands in zip(texts, logits, six):
            [token_stats(lg, c, s) for c in cands]
        alone = (time.perf_counter() - t) / (4 * 6)
        t = time.perf_counter()
        for s, lg, cands in zip(texts, logits, six):
            token_stats_many(lg, cands, s)
        shared = (time.perf_counter() - t) / (4 * 6)
        print(f"statistics, one text, per candidate of six: {alone:.3f} s one at a time, {shared:.3f} s sharing "
              f"the baseline's part")
    t = time.perf_counter()
    generation.greedy(None, [s[:100] for s in texts], 16)
    print(f"greedy generation, 16 prompts x 16 tokens (engine start included): {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    mc.evaluate({"baseline": model}, tok, ["general_knowledge"], 50)
    print(f"multiple choice, 50 items: {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
