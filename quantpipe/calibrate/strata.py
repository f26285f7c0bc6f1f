"""Strata: what each sample is labelled by, and how many of each the sample gets.

A stratum is the cross product of the keys asked for (`metadata.task`, `endpoint`,
`model`, `label`, `length`, `cluster`); cells no record falls into never exist. Its
name is `key=value` pairs joined by `|`, e.g. `metadata.task=code|length=128-255`.
"""

from __future__ import annotations

import math
import re

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


def cluster_text(rec) -> str:
    """What `cluster` strata are computed from: the request's first user turn (the prompt, or the text, else).

    The task a request belongs to is set by what its client sends first. The system prompt
    says more about who is calling than about the task (one per tenant or app, shared by all
    of its tasks), the model's reply is the model's wording, and later turns are follow-ups
    ("why?", "shorter, please") that look alike across tasks; each of these pulls clusters
    towards the caller or the conversation instead of the task.
    """
    if rec.messages is not None:
        return next((m["content"] for m in rec.messages if m["role"] == "user"), rec.messages[0]["content"])
    if rec.prompt is not None:
        return rec.prompt
    return rec.text or ""


# Cluster features. Requests of one task share a template (an instruction, a question
# pattern, a format), while what fills it (the document, the code, the sentence) changes
# from request to request, so clusters of all the words follow topics, not tasks. Three
# views look at the template instead, each weighted equally:
#   - ends: the words of the first and of the last line, where prompts put their instruction
#     and their ask ("Summarize ...:", "... Answer with the letter."); tagged by end.
#   - skeleton: character 3-4-grams of the text with every word written `w` and every
#     number `0` (line breaks kept as `n`): the format (prose, code, lists of options,
#     `Label: x` examples, Q&A) whatever the topic or the language.
#   - shape: how the text ends (a question, a colon left to fill, code, a sentence) and
#     whether it holds a code fence.
# A low-rank projection (TruncatedSVD) keeps the directions many requests share, so the
# many wordings of one template family fall together instead of each making a cluster.
_WORDS = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")
_SKEL_WORD = re.compile(r"[^\W\d_]+")
_SKEL_NUM = re.compile(r"\d+")
_SKEL_BREAK = re.compile(r"\n\s*")
_SKEL_SPACE = re.compile(r"[ \t\f\v]+")
_CLUSTER_CHARS = 4000  # of each end of a long text: the template sits at its ends
_SVD_DIMS = 10
_SKEL_NGRAMS = (3, 4)
_KMEANS_FIT = 20000


def _clip(text: str) -> str:
    if len(text) <= 2 * _CLUSTER_CHARS:
        return text
    return text[:_CLUSTER_CHARS] + "\n" + text[-_CLUSTER_CHARS:]


def _end_lines(text: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if _WORDS.search(ln)]
    if not lines:
        return ["(empty)"]
    return [f"first:{w.lower()}" for w in _WORDS.findall(lines[0])] + \
        [f"last:{w.lower()}" for w in _WORDS.findall(lines[-1])]


def _skeleton(text: str) -> str:
    text = _SKEL_NUM.sub("0", _SKEL_WORD.sub("w", text))
    return _SKEL_SPACE.sub(" ", _SKEL_BREAK.sub("n", text))


def _shape(text: str) -> list[str]:
    stripped = text.rstrip()
    last = stripped[-1:]
    out = ["ends:" + (last if last in "?:.!)`\"'" else "word" if last.isalnum() else "other" if last else "empty")]
    if "```" in text:
        out.append("fence")
    return out


def _cluster_features(texts: list[str], seed: int):
    """(rows as unit vectors for k-means, ends block, ends vectorizer); see the comment above."""
    from scipy import sparse
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.preprocessing import normalize

    texts = [_clip(t) for t in texts]
    ends_vec = TfidfVectorizer(analyzer=_end_lines, min_df=2, sublinear_tf=True, dtype=np.float32)
    blocks = []
    for vec, docs in ((ends_vec, texts),
                      (TfidfVectorizer(analyzer="char", ngram_range=_SKEL_NGRAMS, min_df=2, max_features=50000,
                                       sublinear_tf=True, dtype=np.float32), [_skeleton(t) for t in texts]),
                      (TfidfVectorizer(analyzer=_shape, sublinear_tf=True, dtype=np.float32), texts)):
        try:
            blocks.append(vec.fit_transform(docs))
        except ValueError:  # too few texts for min_df: this view has nothing to say
            blocks.append(sparse.csr_matrix((len(texts), 1), dtype=np.float32))
    ends = blocks[0]
    X = sparse.hstack([normalize(b) for b in blocks]).tocsr()
    dims = min(_SVD_DIMS, X.shape[1] - 1, len(texts) - 1)
    if dims >= 2:
        with np.errstate(divide="ignore", invalid="ignore"):  # all rows alike: no variance to explain
            X = TruncatedSVD(dims, random_state=seed).fit_transform(X)
    return normalize(X), ends, ends_vec


def cluster_labels(texts: list[str], k_range: tuple[int, int], seed: int) -> tuple[list[str], dict]:
    """Unsupervised task types: template features (see above) + MiniBatchKMeans, k chosen by silhouette.

    Each cluster is named by the words of the first and last lines that set it most apart
    from the rest, e.g. `2:letter,options,answer`.
    """
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.metrics import silhouette_score

    n = len(texts)
    lo, hi = k_range
    hi = min(hi, n - 1)
    if n < 3 or hi < lo:
        return ["0"] * n, {"k": 1, "silhouette": None, "names": {"0": "all"}}
    X, ends, ends_vec = _cluster_features(texts, seed)
    rng = np.random.default_rng(seed)
    probe = rng.choice(n, size=min(n, 4000), replace=False) if n > 4000 else np.arange(n)
    # Centroids are fitted on at most _KMEANS_FIT records (a few per template is plenty);
    # every record then takes its nearest one.
    fit = np.sort(rng.choice(n, size=_KMEANS_FIT, replace=False)) if n > _KMEANS_FIT else np.arange(n)
    best = None
    scores = {}
    for k in range(lo, hi + 1):
        km = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=3, batch_size=2048).fit(X[fit])
        labels = km.predict(X)
        if len(set(labels[probe])) < 2:
            continue
        score = float(silhouette_score(X[probe], labels[probe], metric="cosine", random_state=seed))
        scores[k] = round(score, 4)
        if best is None or score > best[0] + 1e-9:
            best = (score, k, labels)
    if best is None:
        return ["0"] * n, {"k": 1, "silhouette": None, "names": {"0": "all"}}
    score, k, labels = best
    names = {}
    try:
        terms = np.array([t.split(":", 1)[-1] for t in ends_vec.get_feature_names_out()])
    except AttributeError:  # the ends view was empty
        terms = np.array([], dtype=str)
    overall = np.asarray(ends.mean(axis=0)).ravel()
    for c in range(k):
        members = labels == c
        lift = np.asarray(ends[members].mean(axis=0)).ravel() - overall if members.any() else overall * 0
        top: list[str] = []
        for j in np.argsort(-lift)[:12] if len(terms) else []:
            if lift[j] > 0 and terms[j] not in top and len(top) < 3:
                top.append(terms[j])
        names[str(c)] = f"{c}:" + (",".join(top) or "-")
    return [names[str(c)] for c in labels], {"k": k, "silhouette": round(score, 4), "silhouette_by_k": scores,
                                            "names": names}
