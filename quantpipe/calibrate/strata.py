"""Strata: what each sample is labelled by, and how many of each the sample gets.

A stratum is the cross product of the keys asked for (`metadata.task`, `endpoint`,
`model`, `label`, `length`, `cluster`); cells no record falls into never exist. Its
name is `key=value` pairs joined by `|`, e.g. `metadata.task=code|length=128-255`.
"""

from __future__ import annotations

import math

import numpy as np

MISSING = "(none)"


def length_bucket(num_tokens: int, edges: list[int]) -> str:
    """Log-spaced buckets by default: '<64', '64-127', ..., '>=2048'."""
    if num_tokens < edges[0]:
        return f"<{edges[0]}"
    for lo, hi in zip(edges, edges[1:]):
        if num_tokens < hi:
            return f"{lo}-{hi - 1}"
    return f">={edges[-1]}"


def stratum_name(values: dict[str, str], keys: list[str]) -> str:
    return "|".join(f"{k}={values[k]}" for k in keys)


def allocate(counts: dict[str, int], total: int, floor: int, weights: dict[str, float] | None = None,
             available: dict[str, int] | None = None) -> tuple[dict[str, int], list[str]]:
    """How many samples each stratum gets: (allocation, under-covered strata).

    Proportional to `counts` (times `weights` for Neyman allocation), with every stratum
    lifted to `floor`; a stratum holding fewer than it is owed gives all it has (it is
    under-covered) and the others share the rest in proportion. Rounding by largest
    remainder, ties broken by name, so the result is deterministic.
    """
    available = available or counts
    w = {s: counts[s] * (weights[s] if weights else 1.0) for s in counts}
    if sum(w.values()) <= 0:
        w = {s: float(counts[s]) for s in counts}
    fixed: dict[str, int] = {}
    while True:
        free = [s for s in counts if s not in fixed]
        budget = total - sum(fixed.values())
        if not free or budget <= 0:
            break
        wsum = sum(w[s] for s in free) or 1.0
        quota = {s: budget * w[s] / wsum for s in free}
        # Pin strata that cannot take their share (too few records) or fall under the floor.
        pinned = False
        for s in sorted(free):
            cap = available[s]
            if quota[s] >= cap:
                fixed[s], pinned = cap, True
            elif quota[s] < floor:
                fixed[s], pinned = min(floor, cap), True
        if not pinned:
            fixed.update(_round(quota, budget))
            break
    alloc = {s: fixed.get(s, 0) for s in counts}
    over = sum(alloc.values()) - total
    if over > 0:  # floors alone exceed the total: trim the largest allocations above the floor
        for s in sorted(alloc, key=lambda s: (-alloc[s], s)):
            take = min(over, max(0, alloc[s] - floor))
            alloc[s] -= take
            over -= take
            if over == 0:
                break
    under = sorted(s for s in counts if available[s] < floor)
    return alloc, under


def _round(quota: dict[str, float], budget: int) -> dict[str, int]:
    base = {s: math.floor(q) for s, q in quota.items()}
    left = budget - sum(base.values())
    for s in sorted(quota, key=lambda s: (-(quota[s] - base[s]), s))[:max(0, left)]:
        base[s] += 1
    return base


def neyman_weights(lengths: dict[str, list[int]]) -> dict[str, float]:
    """Within-stratum standard deviation of token length (Neyman allocation)."""
    return {s: float(np.std(v)) if len(v) > 1 else 0.0 for s, v in lengths.items()}


def cluster_labels(texts: list[str], k_range: tuple[int, int], seed: int) -> tuple[list[str], dict]:
    """Unsupervised topics: TF-IDF + MiniBatchKMeans, k chosen by silhouette, each named by top terms."""
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics import silhouette_score

    n = len(texts)
    lo, hi = k_range
    hi = min(hi, n - 1)
    if n < 3 or hi < lo:
        return ["0"] * n, {"k": 1, "silhouette": None, "names": {"0": "all"}}
    # Words of 2+ letters only: chat-template markers and numbers say nothing about the topic.
    vec = TfidfVectorizer(max_features=20000, sublinear_tf=True, min_df=2, max_df=0.5,
                          token_pattern=r"(?u)\b[a-zA-Z_][a-zA-Z_]+\b", dtype=np.float32)
    X = vec.fit_transform(texts)
    rng = np.random.default_rng(seed)
    probe = rng.choice(n, size=min(n, 4000), replace=False) if n > 4000 else np.arange(n)
    best = None
    scores = {}
    for k in range(lo, hi + 1):
        km = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=3, batch_size=2048)
        labels = km.fit_predict(X)
        if len(set(labels[probe])) < 2:
            continue
        score = float(silhouette_score(X[probe], labels[probe], metric="cosine", random_state=seed))
        scores[k] = round(score, 4)
        if best is None or score > best[0] + 1e-9:
            best = (score, k, km, labels)
    if best is None:
        return ["0"] * n, {"k": 1, "silhouette": None, "names": {"0": "all"}}
    score, k, km, labels = best
    terms = np.array(vec.get_feature_names_out())
    names = {}
    for c in range(k):
        top = terms[np.argsort(-km.cluster_centers_[c])[:3]]
        names[str(c)] = f"{c}:" + ",".join(top)
    return [names[str(c)] for c in labels], {"k": k, "silhouette": round(score, 4), "silhouette_by_k": scores,
                                            "names": names}
