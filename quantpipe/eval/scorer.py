"""Teacher-forced quality of a candidate against its baseline, overall and per stratum.

For every held-out text both models see the same tokens; at each position the scorer
compares the candidate's next-token distribution with the baseline's:
- perplexity of each model (exp of the mean negative log-likelihood of the real next token),
- KL(baseline || candidate) per token: mean and P99,
- top-1 agreement, and the share of tokens whose baseline top-1 is outside the candidate's top-5.

Scoring is batch-invariant: float32, whose rows do not depend on the rows beside them, so
the same text always gets the same numbers whatever else is scored, alone or beside other
texts in one pass; tests check that the baseline against itself gives KL 0 and agreement
100% under any order, and that texts scored together get the numbers one text per call
gives.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from quantpipe.runtime.model.divergence import chunk_rows, exp_parts, kl_from_parts
from quantpipe.runtime.model.forward import final_hidden, head_logits, runs

MAX_ROWS = 2048  # tokens of consecutive texts that go through the layers together


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
def token_stats_many(base_logits: torch.Tensor, cand_logits: list[torch.Tensor], ids: list[int]) -> list[TokenStats]:
    """Per-token statistics of each candidate against the baseline, from float32 logits
    [T-1, V] for the text `ids`. What depends on the baseline alone is computed once per
    chunk of rows and serves every candidate.

    KL comes from `quantpipe.runtime.model.divergence` (float32 passes over the vocabulary,
    per-row sums in float64: a test holds KL and NLL to a float64 log-softmax within 1e-7
    per token, plus 1e-6 of the KL); the NLL uses the same row parts, m + log s - logit.
    0.60x the time of the float64 code on the default model, 0.20x on Gemma 3's vocabulary
    (BENCHMARKS.md, "The scorer's statistics in float32 passes"). Top-5: the baseline's
    top-1 is in the candidate's top 5 unless 5 entries score strictly above it.
    """
    target = torch.tensor(ids[1:]).unsqueeze(1)
    parts: list[dict[str, list]] = [defaultdict(list) for _ in cand_logits]
    rows = chunk_rows(base_logits.shape[-1])
    for r in range(0, len(target), rows):
        xb, t = base_logits[r: r + rows], target[r: r + rows]
        mb, top1, eb, sb = exp_parts(xb)
        nll_base = (mb - xb.gather(1, t).double() + sb.log()).squeeze(1)
        for logits, out in zip(cand_logits, parts):
            xc = logits[r: r + rows]
            mc, top1_c, _, sc = exp_parts(xc)
            out["nll_base"].append(nll_base)
            out["nll_cand"].append((mc - xc.gather(1, t).double() + sc.log()).squeeze(1))
            out["kl"].append(kl_from_parts(xb, mb, eb, sb, xc, mc, sc).squeeze(1))
            out["agree"].append((top1 == top1_c).squeeze(1).double())
            out["top5_miss"].append(((xc > xc.gather(1, top1)).sum(-1) >= 5).double())
    return [TokenStats(**{k: torch.cat(v).numpy() for k, v in out.items()}) for out in parts]


def token_stats(base_logits: torch.Tensor, cand_logits: torch.Tensor, ids: list[int]) -> TokenStats:
    """Per-token statistics of one candidate (see token_stats_many)."""
    return token_stats_many(base_logits, [cand_logits], ids)[0]


def score_many(baseline, candidates: list, tokenizer, texts: list[str], strata: list[str] | None = None,
               max_tokens: int = 512, max_rows: int = MAX_ROWS) -> list[QualityScores]:
    """Score every candidate on `texts` (each cut to `max_tokens`); all models float32.

    Consecutive texts of up to `max_rows` tokens in all go through each model's layers
    together (`final_hidden`), then each text's logits are computed and scored alone: the
    baseline's serve every candidate and are dropped, so memory holds one text's logits per
    model and the run's hidden states, however many texts there are. The numbers are the
    ones one text per call gives (`max_rows=1`), to the bit.
    """
    outs = [QualityScores() for _ in candidates]
    encoded = [(i, ids) for i, text in enumerate(texts) if len(ids := tokenizer.encode(text)[:max_tokens]) >= 2]
    for run in runs([len(ids) for _, ids in encoded], max_rows):
        chunk = encoded[run]
        seqs = [ids for _, ids in chunk]
        base_states = final_hidden(baseline, seqs)
        cand_states = [base_states if model is baseline else final_hidden(model, seqs) for model in candidates]
        for k, (i, ids) in enumerate(chunk):
            with torch.inference_mode():
                base_logits = head_logits(baseline, base_states[k])[:-1]
                cand_logits = [base_logits if model is baseline else head_logits(model, states[k])[:-1]
                               for model, states in zip(candidates, cand_states)]
            for out, stats in zip(outs, token_stats_many(base_logits, cand_logits, ids)):
                out.texts.append(stats)
                out.strata.append(strata[i] if strata else "all")
    return outs


def score(baseline, candidate, tokenizer, texts: list[str], strata: list[str] | None = None,
          max_tokens: int = 512) -> QualityScores:
    """One candidate against its baseline (see score_many)."""
    return score_many(baseline, [candidate], tokenizer, texts, strata, max_tokens)[0]
