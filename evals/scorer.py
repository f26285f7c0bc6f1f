"""Teacher-forced quality of a candidate against its baseline, overall and per stratum.

For every held-out text both models see the same tokens; at each position the scorer
compares the candidate's next-token distribution with the baseline's:
- perplexity of each model (exp of the mean negative log-likelihood of the real next token),
- KL(baseline || candidate) per token: mean and P99,
- top-1 agreement, and the share of tokens whose baseline top-1 is outside the candidate's top-5.

Scoring is batch-invariant: float32, one text per forward call (fixed shapes), so the same
text always gets the same numbers whatever else is scored; a test checks that the baseline
against itself gives KL 0 and agreement 100% under any order.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from quantpipe.runtime.model.forward import sequence_logits


@dataclass
class TokenStats:
    """Per-token arrays for one text (kept so bootstrap CIs can resample texts)."""

    nll_base: np.ndarray
    nll_cand: np.ndarray
    kl: np.ndarray
    agree: np.ndarray
    top5_miss: np.ndarray


@dataclass
class QualityScores:
    texts: list[TokenStats] = field(default_factory=list)
    strata: list[str] = field(default_factory=list)

    def summary(self, idx: list[int] | None = None) -> dict:
        idx = range(len(self.texts)) if idx is None else idx
        parts = [self.texts[i] for i in idx]
        if not parts:
            return {"texts": 0, "tokens": 0}
        cat = {k: np.concatenate([getattr(p, k) for p in parts]) for k in TokenStats.__dataclass_fields__}
        ppl_b = math.exp(cat["nll_base"].mean())
        ppl_c = math.exp(cat["nll_cand"].mean())
        return {
            "texts": len(parts), "tokens": int(len(cat["kl"])),
            "ppl_baseline": ppl_b, "ppl_candidate": ppl_c, "ppl_delta_pct": 100 * (ppl_c / ppl_b - 1),
            "kl_mean": float(cat["kl"].mean()), "kl_p99": float(np.percentile(cat["kl"], 99)),
            "top1_agreement": float(cat["agree"].mean()), "top5_miss": float(cat["top5_miss"].mean()),
        }

    def by_stratum(self) -> dict[str, dict]:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(self.strata):
            groups[s].append(i)
        return {s: self.summary(idx) for s, idx in sorted(groups.items())}


@torch.inference_mode()
def token_stats(baseline, candidate, ids: list[int], baseline_logp: torch.Tensor | None = None) -> TokenStats:
    lb = baseline_logp if baseline_logp is not None else F.log_softmax(sequence_logits(baseline, ids)[:-1].double(), -1)
    lc = F.log_softmax(sequence_logits(candidate, ids)[:-1].double(), -1)
    target = torch.tensor(ids[1:]).unsqueeze(1)
    kl = (lb.exp() * (lb - lc)).sum(-1).clamp(min=0)
    top1 = lb.argmax(-1)
    top5 = lc.topk(5, -1).indices
    return TokenStats(
        nll_base=(-lb.gather(1, target)).squeeze(1).numpy(), nll_cand=(-lc.gather(1, target)).squeeze(1).numpy(),
        kl=kl.numpy(), agree=(top1 == lc.argmax(-1)).numpy().astype(np.float64),
        top5_miss=(~(top5 == top1.unsqueeze(1)).any(-1)).numpy().astype(np.float64))


def score(baseline, candidate, tokenizer, texts: list[str], strata: list[str] | None = None,
          max_tokens: int = 512, cache: dict | None = None) -> QualityScores:
    """Score `texts` (each cut to `max_tokens`); both models should be float32.

    `cache` (a dict kept across calls) holds the baseline's float32 logits, so scoring
    several candidates against one baseline runs the baseline once per text (the same
    numbers as without it: the log-softmax is recomputed from the same logits).
    """
    out = QualityScores()
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)[:max_tokens]
        if len(ids) < 2:
            continue
        base_lp = None
        if cache is not None:
            key = tuple(ids)
            if key not in cache:
                with torch.inference_mode():
                    cache[key] = sequence_logits(baseline, ids)[:-1]
            base_lp = F.log_softmax(cache[key].double(), -1)
        out.texts.append(token_stats(baseline, candidate, ids, base_lp))
        out.strata.append(strata[i] if strata else "all")
    return out
