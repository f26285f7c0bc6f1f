"""The calibrate stage's token counter gives exactly the tokenizer's own counts."""

from __future__ import annotations

import gzip
import json
import os
import random

import pytest

from quantpipe.calibrate.sources import parse_request_log
from quantpipe.calibrate.stage import render
from quantpipe.calibrate.token_count import TokenCounter
from quantpipe.runtime.model.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = os.path.join(ROOT, "calib_sets", "sample", "requests.jsonl.gz")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _exact(tokenizer, texts: list[str]) -> list[int]:
    return [len(e.ids) for e in tokenizer.backend.encode_batch(texts, add_special_tokens=False)]


def test_replays_the_default_models_split(tokenizer):
    counter = TokenCounter(tokenizer.backend)
    assert counter.replayable == {"digits": True, "added": counter.replayable["added"]}
    assert "<|im_start|>" in counter.replayable["added"]


@pytest.mark.skipif(not os.path.exists(SAMPLE), reason="the shipped sample log is not built")
def test_counts_equal_the_tokenizers_on_real_log_text(tokenizer):
    texts = []
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            rec = parse_request_log(json.loads(line), 0, n)
            if rec.status == "ok":
                texts.append(render(rec, tokenizer))
    counter = TokenCounter(tokenizer.backend)
    assert counter.count(texts) == _exact(tokenizer, texts)
    assert counter.fast > 0.7 * len(texts)  # 78% of the sample is ASCII and takes the replayed split
    assert counter.encoded > 0  # some is not (IPA, curly quotes) and takes the encoder


def test_counts_equal_the_tokenizers_on_every_ascii_boundary(tokenizer):
    # Random strings over the characters where the split's stages meet: whitespace runs
    # before digits and added tokens, contractions, punctuation runs, every ASCII char.
    rng = random.Random(0)
    alphabet = [chr(i) for i in range(128)] + [" ", "  ", "\n", "\n\n ", "\t", "<|im_end|>", "<|im_start|>",
                                               "'s", "'ll", "'re", "123", " 4", "ab", " Cd", "__", "-->"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(5000)]
    texts += ["", " ", "7", " 7 ", "x  7", "x \n 7", "a <|im_end|>", "a  <|im_end|> b", "<|im_start|><|im_end|>"]
    counter = TokenCounter(tokenizer.backend)
    assert counter.count(texts) == _exact(tokenizer, texts)
    assert counter.encoded == 0


def test_a_tokenizer_whose_split_it_cannot_replay_is_counted_by_the_encoder(tokenizer):
    from tokenizers import Tokenizer, normalizers

    backend = Tokenizer.from_str(tokenizer.backend.to_str())
    backend.normalizer = normalizers.Lowercase()
    counter = TokenCounter(backend)
    assert counter.replayable is None
    texts = ["Hello World, 123", "MiXeD CaSe text"]
    assert counter.count(texts) == [len(backend.encode(t, add_special_tokens=False).ids) for t in texts]
    assert counter.encoded == 2


def test_the_piece_cache_is_bounded(tokenizer, monkeypatch):
    from quantpipe.calibrate import token_count

    monkeypatch.setattr(token_count, "_MAX_CACHE", 50)
    counter = TokenCounter(tokenizer.backend)
    rng = random.Random(1)
    texts = [" ".join("".join(rng.choice("abcdefgh") for _ in range(6)) for _ in range(30)) for _ in range(20)]
    assert counter.count(texts) == _exact(tokenizer, texts)
    assert len(counter.cache) <= 50
