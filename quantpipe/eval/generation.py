"""Greedy generation agreement: candidate vs baseline on the same held-out prompts.

Both run in the runtime (`LLM`, float32) over the same prompts in the same order and
batch, so the baseline against itself agrees exactly; the candidate's departures are its
own. A held-out text is cut before its last assistant reply, which becomes the thing
to generate; a text without a chat turn is cut at half its tokens.
"""

from __future__ import annotations

from quantpipe.runtime import LLM, SamplingParams


def assistant_header(tokenizer) -> str | None:
    """What the chat template puts before an assistant reply (None without a template)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    msgs = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(msgs, True)
    without = tokenizer.apply_chat_template(msgs, False)
    return with_prompt[len(without):] if with_prompt.startswith(without) else None


def prompts_from(texts: list[str], tokenizer) -> list[list[int]]:
    header = assistant_header(tokenizer)
    out = []
    for text in texts:
        cut = text.rfind(header) if header else -1
        if cut > 0:
            out.append(tokenizer.encode(text[: cut + len(header)]))
        else:
            ids = tokenizer.encode(text)
            out.append(ids[: max(1, len(ids) // 2)])
    return out


def greedy(model: str | None, prompts: list[list[int]], max_tokens: int, max_model_len: int = 2048) -> list[list[int]]:
    llm = LLM(model, dtype="float32", kv_cache_memory="256MiB", max_num_seqs=16, max_model_len=max_model_len,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs]


def agreement(base: list[list[int]], cand: list[list[int]]) -> dict:
    """Exact-match rate and mean length of the common prefix, per prompt."""
    exact, prefix = [], []
    for b, c in zip(base, cand):
        n = 0
        for x, y in zip(b, c):
            if x != y:
                break
            n += 1
        exact.append(float(b == c))
        prefix.append(float(n))
    return {"exact": exact, "prefix": prefix}
