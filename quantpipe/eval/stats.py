"""Paired bootstrap confidence intervals for candidate-vs-baseline quality deltas.

The unit of resampling is the text, not the token: tokens of one text are correlated, so
resampling tokens would give intervals that are too narrow. Baseline and candidate are
scored on the same texts, so each replicate draws one set of texts for both (paired).
Means are computed from per-text sums (one matrix product per metric for all
replicates); the P99 of per-token KL needs the tokens themselves and is done in chunks.
"""

from __future__ import annotations

import math

import numpy as np

from quantpipe.eval.scorer import QualityScores

# metric -> how a replicate's value is computed from per-text sums
MEAN_METRICS = ("kl_mean", "top1_agreement", "top5_miss")


def _interval(values: np.ndarray, point: float, level: float) -> dict:
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return {"point": point, "ci_lower": float(lo), "ci_upper": float(hi)}


def quality_with_ci(scores: QualityScores, idx: list[int], replicates: int = 1000, seed: int = 0,
                    level: float = 0.95) -> dict:
    """summary() of the texts `idx`, each delta metric as {point, ci_lower, ci_upper}."""
    point = scores.summary(idx)
    if not idx:
        return point
    parts = [scores.texts[i] for i in idx]
    tokens = np.array([len(p.kl) for p in parts], dtype=np.float64)
    sums = {
        "nll_base": np.array([p.nll_base.sum() for p in parts]),
        "nll_cand": np.array([p.nll_cand.sum() for p in parts]),
        "kl_mean": np.array([p.kl.sum() for p in parts]),
        "top1_agreement": np.array([p.agree.sum() for p in parts]),
        "top5_miss": np.array([p.top5_miss.sum() for p in parts]),
    }
    rng = np.random.default_rng(seed)
    n = len(parts)
    # counts[b, i]: how often text i is drawn in replicate b (multinomial = n draws with replacement)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=replicates).astype(np.float64)
    ntok = counts @ tokens
    out = dict(point)
    ppl_b = np.exp(counts @ sums["nll_base"] / ntok)
    ppl_c = np.exp(counts @ sums["nll_cand"] / ntok)
    out["ppl_delta_pct"] = _interval(100 * (ppl_c / ppl_b - 1), point["ppl_delta_pct"], level)
    for m in MEAN_METRICS:
        out[m] = _interval(counts @ sums[m] / ntok, point[m], level)
    out["kl_p99"] = _interval(_weighted_p99(parts, counts), point["kl_p99"], level)
    out["replicates"], out["level"] = replicates, level
    return out


def _weighted_p99(parts, counts: np.ndarray, chunk: int = 64) -> np.ndarray:
    """P99 of the per-token KL of each replicate: every token weighted by its text's count."""
    kl = np.concatenate([p.kl for p in parts])
    text_of = np.repeat(np.arange(len(parts)), [len(p.kl) for p in parts])
    order = np.argsort(kl, kind="stable")
    kl, text_of = kl[order], text_of[order]
    out = np.empty(len(counts))
    for start in range(0, len(counts), chunk):
        w = counts[start:start + chunk][:, text_of]  # (chunk, tokens), in KL order
        cum = np.cumsum(w, axis=1)
        target = 0.99 * cum[:, -1:]
        pos = (cum < target).sum(axis=1)  # first token whose cumulative weight reaches 99%
        out[start:start + chunk] = kl[np.minimum(pos, len(kl) - 1)]
    return out


def mean_with_se(values: list[float]) -> dict:
    """Mean of 0/1 (or real) per-item scores and its standard error, lm-eval style."""
    n = len(values)
    if n == 0:
        return {"point": None, "stderr": None, "n": 0}
    m = sum(values) / n
    var = sum((v - m) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {"point": m, "stderr": math.sqrt(var / n), "n": n}


def recovery_and_flips(base: list[float], cand: list[float], replicates: int = 1000, seed: int = 0) -> dict:
    """Per-item scores of two models on the same items: recovery (candidate mean / baseline
    mean) and, when every score is 0 or 1, flips (items whose correctness changed, counted
    both ways) as a share in percent; each with a paired bootstrap 95% CI over items. A
    baseline mean of 0 has no recovery."""
    bv, cv = np.asarray(base, dtype=np.float64), np.asarray(cand, dtype=np.float64)
    n = len(bv)
    out: dict = {}
    if n == 0:
        return out
    counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=replicates).astype(np.float64)
    if bv.mean() > 0:
        b_rep, c_rep = counts @ bv, counts @ cv
        keep = b_rep > 0
        out["recovery"] = _interval(c_rep[keep] / b_rep[keep], float(cv.mean() / bv.mean()), 0.95)
    if set(np.unique(np.concatenate([bv, cv]))) <= {0.0, 1.0}:
        flipped = (bv != cv).astype(np.float64)
        out["flips"] = {"to_wrong": int(((bv == 1) & (cv == 0)).sum()), "to_right": int(((bv == 0) & (cv == 1)).sum())}
        out["flips_pct"] = _interval(100 * (counts @ flipped) / n, float(100 * flipped.mean()), 0.95)
    return out
