"""Whole sequences through the runtime's own model code, outside the engine.

Calibration (GPTQ, AWQ, sensitivity) and teacher-forced scoring need every position's
hidden states or logits for a text. They reuse the engine's model and attention
unchanged: a scratch KV cache of the sequence's length and one prefill span per sequence,
so the numbers are exactly the ones serving computes. Several sequences may share a call
(`SequenceBatch`, `final_hidden`), each its own causal span: in float32 a row does not
depend on the rows beside it, so a text gets the same numbers alone or beside others (the
scorer's and the sensitivity table's tests check it against one sequence per call).
"""

from __future__ import annotations

import torch

from quantpipe.runtime.model.attention import AttentionMetadata, PrefillSpan
from quantpipe.runtime.model.kv_cache import layer_cache
from quantpipe.runtime.model.llama import LlamaForCausalLM


class SequencePass:
    """Per-layer access to one sequence's forward pass (for layer-by-layer calibration)."""

    def __init__(self, model: LlamaForCausalLM, ids: list[int] | torch.Tensor):
        p = next(model.parameters())
        self.model = model
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=p.device)
        n = len(self.ids)
        self.meta = AttentionMetadata(slot_mapping=torch.arange(n, device=p.device), block_size=1,
                                      prefills=[PrefillSpan(0, n, n, None)])
        dtype = model.embed_tokens.weight.dtype
        positions = torch.arange(n, device=p.device)
        self.rope = model.rope(positions, dtype)

    def embed(self) -> torch.Tensor:
        return self.model.embed(self.ids)

    def layer(self, i: int, x: torch.Tensor, kv=None) -> torch.Tensor:
        # A scratch cache per call, in the model's KV format (scoring a KV-quantized model
        # includes the cache's rounding) unless `kv` is given; the layer writes and reads it
        # within this call.
        kv = kv if kv is not None else layer_cache(self.model, i, len(self.ids), self.ids.device)
        return self.model.layers[i](x, self.rope, kv, self.meta)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return head_logits(self.model, x)


def head_logits(model: LlamaForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """float32 logits of the last layer's hidden states x [T, hidden]."""
    return model.lm_head(model.norm(x)).float()


def runs(lengths: list[int], limit: int) -> list[slice]:
    """Consecutive runs of `lengths`, in order, each summing to at most `limit` (a longer one alone)."""
    out, first, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > first and total + n > limit:
            out.append(slice(first, i))
            first, total = i, 0
        total += n
    return out + [slice(first, len(lengths))] if lengths else out


class SequenceBatch:
    """Several sequences' passes flattened into one, each a causal span of its own that attends
    to no other: one call per layer for a mini-batch (learned rounding takes gradients through
    a layer over several sequences at once). `dtype`: the rope tables and scratch caches in
    this dtype, for a copy of a layer converted to it; the model's own dtype by default."""

    def __init__(self, model: LlamaForCausalLM, seqs: list[list[int]], dtype: torch.dtype | None = None):
        p = next(model.parameters())
        self.model = model
        self.dtype = dtype or model.embed_tokens.weight.dtype
        lengths = [len(s) for s in seqs]
        starts = [sum(lengths[:j]) for j in range(len(seqs))]
        self.tokens, self.lengths = sum(lengths), lengths
        self.ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=p.device)
        self.meta = AttentionMetadata(slot_mapping=torch.arange(self.tokens, device=p.device), block_size=1,
                                      prefills=[PrefillSpan(a, n, n, None) for a, n in zip(starts, lengths)])
        positions = torch.cat([torch.arange(n, device=p.device) for n in lengths])
        self.rope = model.rope(positions, self.dtype)

    def layer(self, i: int, x: torch.Tensor, module: torch.nn.Module | None = None) -> torch.Tensor:
        """Layer i (or `module`, a copy of it) on x [tokens, hidden], the sequences' rows in order."""
        kv = layer_cache(self.model, i, self.tokens, x.device, self.dtype)
        return (module or self.model.layers[i])(x, self.rope, kv, self.meta)

    def embed(self) -> torch.Tensor:
        return self.model.embed(self.ids)

    def layers(self, x: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Layers first.. of the model on x [tokens, hidden] (x enters layer `first`)."""
        for i in range(first, len(self.model.layers)):
            x = self.layer(i, x)
        return x


@torch.inference_mode()
def final_hidden(model: LlamaForCausalLM, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The last layer's hidden states [len(seq), hidden] of each sequence, all of them through
    one call per layer (`SequenceBatch`). float32 rows do not depend on the rows beside them,
    so each sequence's states are the ones `sequence_logits` computes alone, to the bit
    (tests/evals/test_scorer.py checks it on the default model); the larger products run
    faster than one sequence at a time."""
    batch = SequenceBatch(model, seqs)
    return list(batch.layers(batch.embed()).split(batch.lengths))


@torch.inference_mode()
def sequence_logits(model: LlamaForCausalLM, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """float32 logits [T, V] for every position of `ids`."""
    run = SequencePass(model, ids)
    x = run.embed()
    for i in range(len(model.layers)):
        x = run.layer(i, x)
    return run.logits(x)


@torch.inference_mode()
def continuation_logits(model: LlamaForCausalLM, prefix: list[int], conts: list[list[int]]) -> list[torch.Tensor]:
    """float32 logits [len(cont), V] predicting each continuation's tokens after `prefix`.

    One flat pass: the prefix once (a causal span), then each continuation as a span that
    reads the prefix's K/V from the scratch cache and its own, never another
    continuation's. Multiple-choice scoring uses it for an item's choices: the prefix is
    computed once however many choices there are, and a fixed item always gives the
    same numbers. lm_head runs only on the rows that predict continuation tokens.
    """
    p = next(model.parameters())
    dev = p.device
    n0 = len(prefix)
    ids = torch.tensor(prefix + [t for c in conts for t in c], dtype=torch.long, device=dev)
    spans, positions, rows, at = [PrefillSpan(0, n0, n0, None)], [torch.arange(n0, device=dev)], [], n0
    for c in conts:
        k = len(c)
        table = torch.cat([torch.arange(n0, device=dev), torch.arange(at, at + k, device=dev)])
        causal = torch.ones(k, n0 + k, dtype=torch.bool, device=dev).tril(n0)  # row j sees prefix + own 0..j
        spans.append(PrefillSpan(at, k, n0 + k, table, causal))
        positions.append(torch.arange(n0, n0 + k, device=dev))
        rows.append(torch.cat([torch.tensor([n0 - 1], device=dev), torch.arange(at, at + k - 1, device=dev)]))
        at += k
    meta = AttentionMetadata(slot_mapping=torch.arange(at, device=dev), block_size=1, prefills=spans)
    dtype = model.embed_tokens.weight.dtype
    rope = model.rope(torch.cat(positions), dtype)
    x = model.embed(ids)
    for i, layer in enumerate(model.layers):
        x = layer(x, rope, layer_cache(model, i, at, dev), meta)
    logits = model.lm_head(model.norm(x.index_select(0, torch.cat(rows)))).float()
    return list(logits.split([len(c) for c in conts]))
