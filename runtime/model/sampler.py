"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

The sampler executes each row's settings; what they are is decided upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingRow:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    generator: torch.Generator | None  # a seeded request's own random stream
    banned_token_ids: list[int]  # e.g. EOS while min_tokens is not reached
    num_logprobs: int | None


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator) -> list[SampleResult]:
    """logits: [R, V] float32, one row per request to sample."""
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, row.banned_token_ids] = float("-inf")
    logprobs = None
    if any(r.num_logprobs is not None for r in rows):
        logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if r.temperature > 0]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        temps = torch.tensor([rows[i].temperature for i in random_rows], device=logits.device).unsqueeze(1)
        # Draws happen on the CPU so a seeded request gives the same tokens on any device.
        probs = _filter(logits[idx] / temps, [rows[i] for i in random_rows]).softmax(dim=-1).cpu()
        for j, i in enumerate(random_rows):
            gen = rows[i].generator or default_generator
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen)[0])
    out = []
    token_list = tokens.tolist()
    for i, row in enumerate(rows):
        res = SampleResult(token_list[i])
        if row.num_logprobs is not None:
            [(res.logprob, res.top_logprobs)] = _pick(logprobs[i:i + 1], [token_list[i]], row.num_logprobs)
        out.append(res)
    return out


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[tuple[float, dict[int, float]]]:
    """logits: [T, V] float32. For each row, the log-probability of its token and the
    `num_top` most likely tokens with theirs (prompt logprobs)."""
    return _pick(torch.log_softmax(logits, dim=-1), token_ids, num_top)


def _pick(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[tuple[float, dict[int, float]]]:
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    if num_top == 0:
        return [(c, {}) for c in chosen]
    vals, ids = logprobs.topk(num_top, dim=-1)
    return [(c, dict(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply top-k, top-p and min-p by setting excluded logits to -inf."""
    if all(r.top_k <= 0 and r.top_p >= 1.0 and r.min_p <= 0.0 for r in rows):
        return logits
    vocab = logits.shape[-1]
    dev = logits.device
    top_k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=dev).unsqueeze(1)
    top_p = torch.tensor([r.top_p for r in rows], device=dev).unsqueeze(1)
    min_p = torch.tensor([r.min_p for r in rows], device=dev).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = ranks >= top_k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p
    drop |= probs < min_p * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
