"""Tokenizers, the default text corpus, and prompt-file readers.

A tokenizer here is any object with `encode(text) -> list[int]`, `decode(ids) -> str` and
a `source` string recorded in results so numbers can be traced to how tokens were counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


class ApproxTokenizer:
    """Whitespace/character tokenizer: a token is optional leading whitespace plus up to 4
    letters, up to 3 digits, or one symbol (~English BPE density). Lossless: decode(encode(t)) == t.
    Fallback when neither the server's nor the model's tokenizer is available."""

    source = "approx"
    _pattern = re.compile(r"\s*(?:[A-Za-z]{1,4}|\d{1,3}|[^\sA-Za-z\d])|\s+")
    # Shared so ids are stable across instances within a process.
    _vocab: dict[str, int] = {}
    _pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self._pattern.findall(text):
            i = self._vocab.get(piece)
            if i is None:
                i = self._vocab[piece] = len(self._pieces)
                self._pieces.append(piece)
            ids.append(i)
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self._pieces[i] for i in ids)


class HTTPTokenizer:
    """The server's own tokenizer via vLLM-style POST /tokenize and /detokenize."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        import logging

        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call would flood logs
        self.base_url = base_url.rstrip("/")
        self.source = f"server:{self.base_url}/tokenize"
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout)

    def encode(self, text: str) -> list[int]:
        r = self._client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def decode(self, ids: list[int]) -> str:
        r = self._client.post("/detokenize", json={"tokens": list(ids)})
        r.raise_for_status()
        return r.json()["prompt"]

    def close(self) -> None:
        self._client.close()


class LocalTokenizer:
    """quantpipe's model tokenizer, imported lazily so the bench works without the engine."""

    def __init__(self, model: str | None = None):
        from quantpipe.runtime.model.tokenizer import load_tokenizer  # lazy: pulls the model stack

        self._tok = load_tokenizer(model)
        self.source = f"local:{model or 'default'}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))


def get_tokenizer(kind: str = "auto", base_url: str | None = None, model: str | None = None):
    """kind: server | local | approx | auto (server if it answers /tokenize, else local, else approx)."""
    if kind in ("server", "auto") and base_url:
        try:
            tok = HTTPTokenizer(base_url)
            tok.encode("probe")
            return tok
        except Exception as e:  # noqa: BLE001 - any failure means "not available"
            if kind == "server":
                raise RuntimeError(f"server tokenizer at {base_url}/tokenize not usable: {e}") from e
    if kind in ("local", "auto"):
        try:
            return LocalTokenizer(model)
        except Exception as e:  # noqa: BLE001
            if kind == "local":
                raise RuntimeError(f"local tokenizer not usable: {e}") from e
    if kind not in ("auto", "approx", "server", "local"):
        raise ValueError(f"tokenizer must be auto, server, local or approx, got {kind!r}")
    return ApproxTokenizer()


# ---- corpus -------------------------------------------------------------------------
_CORPUS_CHARS = 200_000  # plenty for 16k-token prompts; keeps server tokenization quick
_corpus_ids: dict[str, list[int]] = {}


def corpus_text() -> str:
    """Real English prose: the Python reference topics shipped with CPython (ASCII only)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text.encode("ascii", "ignore").decode()[:_CORPUS_CHARS]


def corpus_ids(tokenizer) -> list[int]:
    key = getattr(tokenizer, "source", repr(tokenizer))
    if key not in _corpus_ids:
        _corpus_ids[key] = list(tokenizer.encode(corpus_text()))
    return _corpus_ids[key]


# ---- prompt files -------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetRow:
    prompt: str
    output_text: str | None = None  # reference reply, if the file has one
    output_tokens: int | None = None  # explicit output length, if the file has one


def load_dataset(path: str | Path, fmt: str = "auto") -> list[DatasetRow]:
    """ShareGPT JSON (list of {"conversations": [{"from": "human", "value": ...}, ...]})
    or JSONL with {"prompt"|"text": ..., optional "output_tokens"|"completion"}."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset file not found: {path}")
    if fmt == "auto":
        fmt = "jsonl" if path.suffix == ".jsonl" else "sharegpt"
    rows: list[DatasetRow] = []
    if fmt == "sharegpt":
        for conv in json.loads(path.read_text()):
            turns = conv.get("conversations") or conv.get("conversation") or []
            for i, t in enumerate(turns):
                if t.get("from", t.get("role")) in ("human", "user") and t.get("value", t.get("content")):
                    nxt = turns[i + 1] if i + 1 < len(turns) else {}
                    reply = nxt.get("value", nxt.get("content")) if nxt.get("from", nxt.get("role")) in ("gpt", "assistant") else None
                    rows.append(DatasetRow(t.get("value", t.get("content")), reply or None))
                    break
    else:
        for n, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n + 1}: not JSON ({e})") from None
            text = d.get("prompt", d.get("text"))
            if not isinstance(text, str):
                raise ValueError(f"{path}:{n + 1}: needs a string 'prompt' or 'text'")
            out = d.get("output_tokens")
            rows.append(DatasetRow(text, d.get("completion", d.get("output")), int(out) if out else None))
    if not rows:
        raise ValueError(f"{path}: no prompts found (format {fmt})")
    return rows
