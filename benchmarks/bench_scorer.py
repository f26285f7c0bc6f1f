"""The scorer's per-token statistics against a float64 log-softmax reference, side by side:
time per 128-token text and the largest per-token difference, on a real model and a
candidate whose Linears (all but the embedding) are rounded to INT8 per channel.

    .venv/bin/python -m benchmarks.bench_scorer [--model gemma3-270m] [--texts 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from quantpipe.eval.scorer import TokenStats, chunk_rows, token_stats
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model
from quantpipe.runtime.workload.text import corpus_text


@torch.inference_mode()
def reference(lb: torch.Tensor, lc: torch.Tensor, ids: list[int]) -> TokenStats:
    """The statistics from a float64 log-softmax over every entry, in chunks of 16
    positions: the scorer before its float32 passes (a84fec2 and earlier)."""
    target = torch.tensor(ids[1:]).unsqueeze(1)
    out: dict[str, list] = {k: [] for k in ("nll_base", "nll_cand", "kl", "agree", "top5_miss")}
    for r in range(0, len(target), 16):
        pb, pc = F.log_softmax(lb[r: r + 16].double(), -1), F.log_softmax(lc[r: r + 16].double(), -1)
        t, top1 = target[r: r + 16], pb.argmax(-1)
        out["nll_base"].append(-pb.gather(1, t).squeeze(1))
        out["nll_cand"].append(-pc.gather(1, t).squeeze(1))
        out["kl"].append((pb.exp() * (pb - pc)).sum(-1).clamp(min=0))
        out["agree"].append((top1 == pc.argmax(-1)).double())
        out["top5_miss"].append((~(pc.topk(5, -1).indices == top1.unsqueeze(1)).any(-1)).double())
    return TokenStats(**{k: torch.cat(v).numpy() for k, v in out.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base, _, tok = load_model(args.model, torch.float32)
    cand, _, _ = load_model(args.model, torch.float32)
    with torch.no_grad():
        for mod in cand.modules():
            if isinstance(mod, torch.nn.Linear) and mod.weight.data_ptr() != base.lm_head.weight.data_ptr():
                w = mod.weight
                s = w.abs().amax(1, keepdim=True) / 127
                w.copy_((w / s).round().clamp(-127, 127) * s)
    ids = tok.encode(corpus_text()[:200000])
    texts = [ids[i * 128:(i + 1) * 128] for i in range(args.texts)]
    with torch.inference_mode():
        logits = [(sequence_logits(base, s)[:-1], sequence_logits(cand, s)[:-1]) for s in texts]
    times: dict[str, list[float]] = {"reference": [], "scorer": []}
    for _ in range(args.repeats):  # alternating, so both see the same machine state
        for name, fn in (("reference", reference), ("scorer", token_stats)):
            t = time.perf_counter()
            out = [fn(lb, lc, s) for (lb, lc), s in zip(logits, texts)]
            times[name].append((time.perf_counter() - t) / len(texts))
            if name == "reference":
                ref = out
            else:
                got = out
    vocab = logits[0][0].shape[-1]
    print(f"model {args.model or 'default'}, vocab {vocab}, {args.texts} texts of 128 tokens, "
          f"{chunk_rows(vocab)} positions per chunk (the reference: 16)")
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.3f} s per text (range {min(ts):.3f}-{max(ts):.3f})")
    print(f"ratio scorer / reference: {statistics.median(times['scorer']) / statistics.median(times['reference']):.2f}")
    for k in ("kl", "nll_base", "nll_cand", "agree", "top5_miss"):
        a, b = (np.concatenate([getattr(r, k) for r in rs]) for rs in (ref, got))
        print(f"{k}: max |difference| {np.abs(a - b).max():.2e}, mean {a.mean():.6f} (reference) {b.mean():.6f}")


if __name__ == "__main__":
    main()
