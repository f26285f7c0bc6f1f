"""Give each RequestSpec real prompt text cut to its exact token count.

Text comes from the corpus (or the spec's dataset). Segments are chosen with an rng keyed
on (seed, request index), so the same spec + seed + tokenizer gives identical prompts.
Shared prefixes are the same token ids for every request of a group; turn k of a session
repeats turn k-1's prompt plus a stand-in reply of the planned length plus new text, so
prefix caches see the reuse a real conversation would produce. The stand-in is for
consumers without a server (simulator, planner); the bench's runner swaps in the reply
the server really gave (`Request.turn_text` is the new user text it appends).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantpipe.runtime.workload.requests import RequestSpec, sample_requests
from quantpipe.runtime.workload.spec import WorkloadSpec
from quantpipe.runtime.workload.text import ApproxTokenizer, corpus_ids, load_dataset


@dataclass
class Request:
    spec: RequestSpec
    prompt: str  # text to send
    prompt_ids: list[int]  # encode(prompt): what the server will see
    tokenizer_source: str
    turn_text: str = ""  # later turns of a session: the user's new text alone

    @property
    def output_tokens(self) -> int:
        return self.spec.output_tokens

    @property
    def arrival_s(self) -> float:
        return self.spec.arrival_s

    @property
    def exact(self) -> bool:
        """True when the text re-encodes to exactly the planned prompt length."""
        return len(self.prompt_ids) == self.spec.prompt_tokens


def _segment(corpus: list[int], rng: np.random.Generator, n: int) -> list[int]:
    start = int(rng.integers(0, len(corpus)))
    reps = (start + n) // len(corpus) + 1
    return (corpus * reps)[start:start + n] if reps > 1 else corpus[start:start + n]


def _fit(ids: list[int], target: int, tokenizer, corpus, rng) -> tuple[str, list[int]]:
    """Decode, re-encode, and trim/extend until the text is exactly `target` tokens.

    BPE merges across cut points can change the count by a token or two; a few rounds fix it.
    """
    text = tokenizer.decode(ids)
    got = tokenizer.encode(text)
    for _ in range(6):
        diff = target - len(got)
        if diff == 0:
            break
        ids = got[:target] if diff < 0 else got + _segment(corpus, rng, diff)
        text = tokenizer.decode(ids)
        got = tokenizer.encode(text)
    return text, got


def materialize(spec: WorkloadSpec, tokenizer=None, *, seed: int | None = None) -> list[Request]:
    """Requests with prompt text and ids; tokenizer defaults to the approximate one."""
    tok = tokenizer if tokenizer is not None else ApproxTokenizer()
    seed = spec.seed if seed is None else seed
    plan = sample_requests(spec, seed, tokenizer=tok)
    corpus = corpus_ids(tok)
    ds = load_dataset(spec.dataset.path, spec.dataset.format) if spec.dataset else None
    prefixes: dict[int, list[int]] = {}
    ids_of: dict[int, list[int]] = {}
    out: list[Request] = []
    for r in plan:
        rng = np.random.default_rng([seed, r.index])
        if ds is not None and r.dataset_index >= 0:
            new = list(tok.encode(ds[r.dataset_index].prompt))
        else:
            new = _segment(corpus, rng, r.new_tokens)
        if r.parent >= 0:
            parent = plan[r.parent]
            ids = ids_of[r.parent] + _segment(corpus, rng, parent.output_tokens) + new
        else:
            ids = new
            if r.prefix_group >= 0:
                if r.prefix_group not in prefixes:
                    prng = np.random.default_rng([seed, 1_000_000 + r.prefix_group])
                    prefixes[r.prefix_group] = _segment(corpus, prng, r.prefix_tokens)
                ids = prefixes[r.prefix_group] + new
        text, ids = _fit(ids, r.prompt_tokens, tok, corpus, rng) if ds is None else (tok.decode(ids), ids)
        ids_of[r.index] = ids
        turn_text = tok.decode(ids[len(ids_of[r.parent]) + plan[r.parent].output_tokens:]) if r.parent >= 0 else ""
        out.append(Request(r, text, ids, getattr(tok, "source", type(tok).__name__), turn_text))
    return out
