"""The teacher-forced scorer: batch-invariant, and it sees damage where there is some."""

from __future__ import annotations

import math
import random

import numpy as np
import torch
import torch.nn.functional as F

from quantpipe.eval.scorer import chunk_rows, score, score_many, token_stats
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model
from tests.model.test_parity_architectures import build


class IdTokenizer:
    """Texts here are space-separated token ids (the small models have no tokenizer)."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


def _texts(n: int = 12) -> list[str]:
    rng = random.Random(0)
    return [" ".join(str(rng.randrange(320)) for _ in range(rng.randint(8, 60))) for _ in range(n)]


def test_baseline_against_itself_in_any_order(tmp_path):
    _, src = build(tmp_path, "llama-tied")
    model, _, _ = load_model(src, torch.float32)
    twin, _, _ = load_model(src, torch.float32)  # loaded apart: the scorer computes both sides
    texts = _texts()
    strata = ["a" if i % 3 else "b" for i in range(len(texts))]
    first = score(model, twin, IdTokenizer(), texts, strata)
    s = first.summary()
    assert s["kl_mean"] == 0 and s["kl_p99"] == 0 and s["top1_agreement"] == 1.0 and s["ppl_delta_pct"] == 0
    # Shuffled order, other texts before them, and other candidates beside them: the
    # same numbers, text for text.
    order = list(range(len(texts)))
    random.Random(1).shuffle(order)
    score(model, model, IdTokenizer(), _texts(5))
    other, _, _ = load_model(src, torch.float32)
    with torch.no_grad():
        other.layers[0].mlp.down_proj.weight.mul_(1.5)
    _, again = score_many(model, [other, model], IdTokenizer(), [texts[i] for i in order], [strata[i] for i in order])
    for j, i in enumerate(order):
        assert (again.texts[j].nll_base == first.texts[i].nll_base).all()
        assert (again.texts[j].kl == first.texts[i].kl).all()
    assert set(first.by_stratum()) == {"a", "b"}


def test_damage_shows_up(tmp_path):
    _, src = build(tmp_path, "llama-tied")
    base, _, _ = load_model(src, torch.float32)
    cand, _, _ = load_model(src, torch.float32)
    with torch.no_grad():
        w = cand.layers[0].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.std())
    s = score(base, cand, IdTokenizer(), _texts()).summary()
    assert s["kl_mean"] > 0.01 and s["top1_agreement"] < 1.0 and s["ppl_delta_pct"] != 0
    with torch.no_grad():
        ids = IdTokenizer().encode(_texts(1)[0])
        lb, lc = sequence_logits(base, ids)[:-1], sequence_logits(cand, ids)[:-1]
    broken = _check_against_float64(lb, lc, ids)
    assert broken.kl.mean() > 10 and 0 < broken.top5_miss.mean() < 1


def _check_against_float64(lb: torch.Tensor, lc: torch.Tensor, ids: list[int]):
    """token_stats against a float64 log-softmax over every entry, for the candidate `lc` and
    for logits far out of range (a broken candidate: KL in the tens): float32 passes with
    float64 row sums stay within 1e-7 per token plus 1e-6 of the KL (float32 rounding of
    logits in the hundreds), and never overflow."""
    target = torch.tensor(ids[1:]).unsqueeze(1)
    for cand_logits in (lc, lb * 40 - lc * 25):
        got = token_stats(lb, cand_logits, ids)
        pb, pc = F.log_softmax(lb.double(), -1), F.log_softmax(cand_logits.double(), -1)
        kl = (pb.exp() * (pb - pc)).sum(-1).clamp(min=0).numpy()
        assert np.allclose(got.kl, kl, rtol=1e-6, atol=1e-7)
        assert np.allclose(got.nll_base, -pb.gather(1, target).squeeze(1).numpy(), rtol=0, atol=1e-7)
        assert np.allclose(got.nll_cand, -pc.gather(1, target).squeeze(1).numpy(), rtol=0, atol=1e-7)
        assert (got.agree == (pb.argmax(-1) == pc.argmax(-1)).double().numpy()).all()
        in_top5 = (pc.topk(5, -1).indices == pb.argmax(-1, keepdim=True)).any(-1)
        assert (got.top5_miss == (~in_top5).double().numpy()).all()
    return got


def test_statistics_of_a_large_vocabulary_in_chunks():
    """A vocabulary of 2^17 entries is scored a few positions at a time (chunk_rows); rows
    across chunk boundaries get what one float64 pass over all of them gives."""
    vocab = 1 << 17
    ids = [i * 7919 % vocab for i in range(3 * chunk_rows(vocab) + 6)]
    g = torch.Generator().manual_seed(0)
    lb = torch.randn(len(ids) - 1, vocab, generator=g) * 3
    lc = lb + torch.randn(lb.shape, generator=g) * 0.05
    lc[::2] += torch.randn(lc[::2].shape, generator=g) * 3  # every other position far off: some top-5 misses
    assert chunk_rows(vocab) < len(ids) // 3
    broken = _check_against_float64(lb, lc, ids)
    assert broken.kl.mean() > 10 and 0 < broken.top5_miss.mean() < 1


def test_statistics_do_not_depend_on_the_thread_count():
    """A Ray task that declares one CPU scores with one thread, the local eval with several:
    every per-token number must be the same bits. A chunk of a single row is the case torch
    would split across threads (1 and chunk + 1 positions make one-row last chunks)."""
    vocab = 1 << 16
    rows = chunk_rows(vocab)
    g = torch.Generator().manual_seed(1)
    out = {}
    # Whether a split sum rounds differently depends on the data (about half the rows here
    # did): twelve texts make a thread-dependent scorer fail this all but surely.
    for n in [2] * 8 + [rows + 2, 2 * rows + 2] * 2:
        ids = [i * 31 % vocab for i in range(n)]
        lb = torch.randn(n - 1, vocab, generator=g) * 3
        lc = lb + torch.randn(lb.shape, generator=g) * 0.1
        saved = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out[threads] = token_stats(lb, lc, ids)
        finally:
            torch.set_num_threads(saved)
        for k in ("nll_base", "nll_cand", "kl", "agree", "top5_miss"):
            assert np.array_equal(getattr(out[1], k), getattr(out[2], k)), (n, k)


def test_perplexity_is_hf_transformers_loss_on_the_same_tokens(tmp_path):
    """Every headline figure is a perplexity delta: the scorer's per-token NLL, averaged, is the
    loss HF transformers computes for the same tokens, and its perplexity exp of the mean."""
    from transformers import AutoModelForCausalLM

    _, src = build(tmp_path, "llama-tied")
    ours, _, _ = load_model(src, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    texts = _texts(6)
    result = score(ours, ours, IdTokenizer(), texts)
    losses, counts = [], []
    with torch.no_grad():
        for text, stats in zip(texts, result.texts):
            ids = torch.tensor([IdTokenizer().encode(text)])
            loss = hf(ids, labels=ids).loss.item()  # mean NLL of tokens 1..n given their prefixes
            assert len(stats.nll_base) == ids.shape[1] - 1
            assert abs(stats.nll_base.mean() - loss) < 1e-4 * max(1.0, loss), (stats.nll_base.mean(), loss)
            losses.append(loss)
            counts.append(ids.shape[1] - 1)
    want = math.exp(sum(loss * n for loss, n in zip(losses, counts)) / sum(counts))
    assert abs(result.summary()["ppl_baseline"] / want - 1) < 1e-4


def test_texts_scored_together_get_the_numbers_of_one_text_per_call(sample_set, w8a16_artifact):
    """The default model and its W8A16 artifact (the packed int8 kernel) in float32, on
    held-out texts of up to 256 tokens: consecutive texts share each layer's call (up to
    `max_rows` tokens), and every per-token number equals the one-text-per-call pass."""
    import json
    from pathlib import Path

    base, _, tok = load_model(None, torch.float32)
    cand, _, _ = load_model(w8a16_artifact, torch.float32)
    rows = [json.loads(line) for line in (Path(sample_set) / "heldout.jsonl").read_text().splitlines()][:5]
    texts = [r["text"] for r in rows]
    alone = score_many(base, [cand, base], tok, texts, max_tokens=256, max_rows=1)
    together = score_many(base, [cand, base], tok, texts, max_tokens=256, max_rows=512)
    lengths = [len(t.kl) + 1 for t in together[0].texts]
    assert lengths[0] + lengths[1] <= 512 < sum(lengths)  # two texts or more per call, and more than one call
    for a, b in zip(alone, together):
        assert len(a.texts) == len(b.texts) == len(texts)
        for x, y in zip(a.texts, b.texts):
            for k in ("nll_base", "nll_cand", "kl", "agree", "top5_miss"):
                assert np.array_equal(getattr(x, k), getattr(y, k)), k
    assert together[0].summary()["kl_mean"] > 0 and together[1].summary()["kl_mean"] == 0
