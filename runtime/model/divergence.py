"""KL divergence between two next-token distributions given as float32 logits, in float32
passes over the vocabulary.

With d = baseline logit - candidate logit, m a row's max and s = sum exp(logit - m) >= 1,
    KL(baseline || candidate) = E_pb[d] - (m_b - m_c) - (log s_b - log s_c).
No log-probability of magnitude ~20 is formed in float32 (its rounding, 2e-6, would exceed
a good candidate's typical per-token KL); the vocabulary passes (exp, the weighted sum of
d) run in float32 and only per-row sums accumulate in float64. Rows are taken a chunk at a
time so the temporaries stay in cache. The eval's scorer and mixed precision's sensitivity
measurement both go through here; the scorer's tests hold the result to a float64
log-softmax within 1e-7 per token (plus 1e-6 of the KL).
"""

from __future__ import annotations

import torch

# Entries of one chunk of rows (positions x vocabulary): 2 MiB of float32, so a chunk's
# temporaries stay in cache. Gemma 3's 262,144-entry vocabulary at 16 rows a chunk took
# 4.2x the time of 2 rows (BENCHMARKS.md, "The scorer's statistics in float32 passes").
CHUNK_ENTRIES = 1 << 19


def chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ENTRIES // vocab)


def row_sums(t: torch.Tensor) -> torch.Tensor:
    """Each row's sum [R, 1] in float64, the same bits whatever torch's thread count.

    torch splits a reduction across threads by its output rows, each row then summed in
    one order, except when there is a single output: then each thread sums a slice of the
    row and the result depends on how many threads there are. A single row is therefore
    summed as two views of itself (its numbers then match a run with another thread count,
    such as a Ray task that declares one CPU)."""
    if t.shape[0] == 1:
        return t.expand(2, -1).sum(-1, keepdim=True, dtype=torch.float64)[:1]
    return t.sum(-1, keepdim=True, dtype=torch.float64)


def exp_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For float32 logits [R, V]: each row's max m (float64), its index, exp(x - m), and the
    row sum s of exp(x - m) accumulated in float64 (the log-sum-exp is m + log s)."""
    m, top1 = x.max(-1, keepdim=True)
    e = (x - m).exp_()
    return m.double(), top1, e, row_sums(e)


def kl_from_parts(xb: torch.Tensor, mb: torch.Tensor, eb: torch.Tensor, sb: torch.Tensor,
                  xc: torch.Tensor, mc: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """Per-row KL(baseline || candidate) [R, 1] in float64 from both sides' logits and
    exp_parts (the candidate's exp itself is not needed)."""
    mean_d = row_sums(eb * (xb - xc)) / sb  # E_pb[d]
    return (mean_d - (mb - mc) - (sb.log() - sc.log())).clamp(min=0)


@torch.inference_mode()
def kl_rows(base: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """KL(baseline || candidate) per row of float32 logits [R, V], float64 [R]."""
    rows, out = chunk_rows(base.shape[-1]), []
    for r in range(0, base.shape[0], rows):
        xb, xc = base[r: r + rows], cand[r: r + rows]
        mb, _, eb, sb = exp_parts(xb)
        mc, _, _, sc = exp_parts(xc)
        out.append(kl_from_parts(xb, mb, eb, sb, xc, mc, sc).squeeze(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
