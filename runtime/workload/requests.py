"""Turn a WorkloadSpec into a deterministic list of RequestSpec (numbers only, no text).

This is what a simulator or planner consumes; `materialize` adds prompt text on top.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from quantpipe.runtime.workload.spec import WorkloadSpec
from quantpipe.runtime.workload.traces import read_trace


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float  # intended send time from the start of the run
    prompt_tokens: int  # total prompt: prefix + conversation history + new user text
    output_tokens: int  # tokens to generate (exact when the spec says ignore_eos)
    new_tokens: int  # the part of the prompt unique to this request
    prefix_group: int = -1  # shared system prompt used, -1 for none
    prefix_tokens: int = 0
    session: int = -1  # multi-turn session id, -1 for single-shot
    turn: int = 0
    parent: int = -1  # index of the previous turn; send only after it finished
    think_time_s: float = 0.0  # pause after the parent finished
    dataset_index: int = -1  # row of spec.dataset providing the text, -1 for corpus text

    def to_dict(self) -> dict:
        return asdict(self)


def sample_requests(spec: WorkloadSpec, seed: int | None = None, tokenizer=None) -> list[RequestSpec]:
    """Requests sorted by arrival; same spec and seed give the same list.

    `tokenizer` is only used to measure dataset prompts (approximate tokenizer if None).
    """
    rng = np.random.default_rng(spec.seed if seed is None else seed)
    arr = spec.arrival
    n_cap = spec.num_requests
    ds_rows = None
    if arr.process == "trace":
        t, p, o = read_trace(arr.path, arr.format)
        t = t * arr.time_scale
        keep = np.ones(len(t), bool) if spec.duration_s is None else t < spec.duration_s
        t, p, o = t[keep], p[keep], o[keep]
        if n_cap is not None:
            t, p, o = t[:n_cap], p[:n_cap], o[:n_cap]
        starts = t
        if arr.use_trace_lengths:
            new = np.maximum(1, np.rint(p * arr.length_scale)).astype(np.int64)
            out = np.maximum(1, np.rint(o * arr.length_scale)).astype(np.int64)
        else:
            new, out = spec.prompt_tokens.sample(rng, len(t)), spec.output_tokens.sample(rng, len(t))
    else:
        starts = arr.sample(rng, n_cap, spec.duration_s)
        new = spec.prompt_tokens.sample(rng, len(starts))
        out = spec.output_tokens.sample(rng, len(starts))
    if spec.dataset is not None:
        from quantpipe.runtime.workload.text import ApproxTokenizer, load_dataset

        tok = tokenizer or ApproxTokenizer()
        ds_rows = load_dataset(spec.dataset.path, spec.dataset.format)
        pick = rng.permutation(len(ds_rows))
    # Shared prefixes: per session (or request), chosen uniformly among the groups.
    sp = spec.shared_prefix
    groups = np.full(len(starts), -1)
    if sp is not None:
        use = rng.uniform(0, 1, len(starts)) < sp.fraction
        groups = np.where(use, rng.integers(0, sp.num_prefixes, len(starts)), -1)
    turns = (spec.sessions.turns.sample(rng, len(starts)) if spec.sessions else np.ones(len(starts), np.int64))
    think = spec.sessions.think_time_s if spec.sessions else 0.0

    rows: list[dict] = []
    k_ds = 0
    for s, t0 in enumerate(starts):
        prev_prompt = prev_out = 0
        g = int(groups[s])
        plen = sp.prefix_tokens if (sp is not None and g >= 0) else 0
        for turn in range(int(turns[s])):
            if turn == 0:
                n_new, n_out = int(new[s]), int(out[s])
            else:  # later turns draw their own lengths
                n_new = int(spec.prompt_tokens.sample(rng, 1)[0])
                n_out = int(spec.output_tokens.sample(rng, 1)[0])
            ds_i = -1
            if ds_rows is not None:
                ds_i = int(pick[k_ds % len(pick)])
                k_ds += 1
                row = ds_rows[ds_i]
                n_new = max(1, len(tok.encode(row.prompt)))
                if row.output_tokens:
                    n_out = row.output_tokens
                elif row.output_text:
                    n_out = max(1, len(tok.encode(row.output_text)))
            prompt = (plen + n_new) if turn == 0 else prev_prompt + prev_out + n_new
            rows.append(dict(arrival_s=float(t0) + turn * think, prompt_tokens=prompt, output_tokens=n_out,
                             new_tokens=n_new, prefix_group=g, prefix_tokens=plen,
                             session=s if spec.sessions else -1, turn=turn,
                             think_time_s=think if turn else 0.0, dataset_index=ds_i))
            prev_prompt, prev_out = prompt, n_out
    # Sort by intended time (stable), then link each turn to its parent's new index.
    order = sorted(range(len(rows)), key=lambda i: rows[i]["arrival_s"])
    if n_cap is not None:
        order = order[:n_cap]  # parents sort before their children, so links stay valid
    result: list[RequestSpec] = []
    last_turn_of: dict[int, int] = {}
    for new_i, old in enumerate(order):
        r = rows[old]
        parent = -1
        if r["session"] >= 0 and r["turn"] > 0:
            parent = last_turn_of.get(r["session"], -1)
        if r["session"] >= 0:
            last_turn_of[r["session"]] = new_i
        result.append(RequestSpec(index=new_i, parent=parent, **r))
    return result
