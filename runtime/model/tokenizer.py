"""Tokenizers from a GGUF's metadata or an HF folder, plus chat templates and
incremental detokenization for streaming and stop strings."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Tokens that end an assistant turn in common chat formats; llama.cpp treats them as
# end-of-generation too, which a GGUF's single eos id does not always say.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<end_of_turn>")


@dataclass
class Tokenizer:
    backend: HFTokenizer
    chat_template: str | None = None
    bos_token_id: int | None = None
    add_bos_token: bool = False
    eos_token_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:  # a template may already start with it
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must have a string 'role' and a string 'content'")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
            )
        except jinja2.UndefinedError as e:
            raise ValueError(f"chat template failed on these messages: {e}") from e


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    # Compiled once per template: a server applies it on every chat request.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

    def raise_exception(message: str):
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces without re-decoding it all.

    Byte-level BPE can split one character over several tokens; a piece that ends in
    an incomplete character is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = decode(self.ids[self.prefix_offset:], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        piece = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += piece
        return piece


CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# Gemma's turn format, for Gemma GGUFs that carry no template (the 270M base model's): a system
# message opens the first user turn, the assistant's role is "model". llama.cpp falls back to
# the same format by name for these files.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}
{%- for m in turns -%}
{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with user') }}
{%- endif -%}
{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'
   + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"""


def tokenizer_from_gguf(gguf) -> Tokenizer:
    """The tokenizer in a GGUF file's metadata (`gguf`: a `gguf_file.GGUFFile`)."""
    kind = gguf.get("tokenizer.ggml.model")
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    types = gguf.get("tokenizer.ggml.token_type", [1] * len(tokens))
    template = gguf.get("tokenizer.chat_template")
    if kind == "llama" and gguf.get("general.architecture") == "gemma3":
        backend, tokens = _gemma_backend(gguf, tokens, types)
        template = template or GEMMA_CHAT_TEMPLATE
    elif kind == "gpt2":
        backend = _byte_level_backend(gguf, tokens, types)
    else:
        raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (byte-level BPE, 'gpt2'; "
                         "SentencePiece BPE, 'llama', for Gemma 3)")
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    eos_ids = [eos] if eos is not None else []
    # Only control tokens end a turn: Gemma's vocabulary also has "</s>" as a user-defined token.
    eos_ids += [i for i, (t, ty) in enumerate(zip(tokens, types))
                if t in END_OF_TURN_TOKENS and ty == CONTROL and i not in eos_ids]
    return Tokenizer(
        backend=backend,
        chat_template=template,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        add_bos_token=bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
        eos_token_ids=tuple(eos_ids),
        special_ids=frozenset(i for i, ty in enumerate(types) if ty == CONTROL),
    )


def _byte_level_backend(gguf, tokens: list[str], types: list[int]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in gguf.metadata["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    pre = gguf.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "default", "gpt-2"):
        # These split digits one by one before the GPT-2 regex.
        steps = [pre_tokenizers.Digits(individual_digits=True), byte_level] if pre != "gpt-2" else [byte_level]
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    else:
        raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported")
    backend.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched whole, never split by BPE.
    specials = [t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def spm_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges recovered from a SentencePiece BPE vocabulary that lists none.

    SentencePiece merges the pair whose merged piece ranks best; in Gemma's vocabulary rank
    is the position in the list (its scores do not follow merge order). Every split of a
    piece into two pieces of the vocabulary is a merge, ranked by the piece's position, and
    within a piece the longer left part first (as Hugging Face's converters order them).
    """
    vocab = set(tokens)
    merges = []
    for piece in tokens:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _gemma_backend(gguf, tokens: list[str], types: list[int]) -> tuple[HFTokenizer, list[str]]:
    """Gemma's SentencePiece BPE (byte fallback, spaces as U+2581, no dummy prefix), and the
    vocabulary as the model spells it.

    The file stores tokens of spaces only as spaces; the model's pieces spell them with
    U+2581, so they are respelled before the merges are recovered from the vocabulary."""
    if gguf.get("tokenizer.ggml.add_space_prefix", False):
        raise ValueError("GGUF tokenizer.ggml.add_space_prefix=True is not supported for Gemma")
    tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = gguf.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(models.BPE(vocab, spm_merges(tokens), unk_token=tokens[unk] if unk is not None else None,
                                     fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens are special; user-defined ones (newline and tab runs) are matched whole, as llama.cpp does.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return backend, tokens


def tokenizer_from_hf(path: str, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    backend = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}

    def token_str(value):
        return value.get("content") if isinstance(value, dict) else value

    bos = token_str(cfg.get("bos_token"))
    eos = token_str(cfg.get("eos_token"))
    bos_id = backend.token_to_id(bos) if bos else None
    eos_ids = list(eos_token_ids)
    if eos and backend.token_to_id(eos) is not None and backend.token_to_id(eos) not in eos_ids:
        eos_ids.append(backend.token_to_id(eos))
    template = cfg.get("chat_template")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jinja_path):
        template = open(jinja_path).read()
    # The HF tokenizer.json post-processor adds BOS itself where the model wants it.
    backend_adds_bos = backend.post_processor is not None
    added = backend.get_added_tokens_decoder() if hasattr(backend, "get_added_tokens_decoder") else {}
    return Tokenizer(
        backend=backend,
        chat_template=template,
        bos_token_id=bos_id,
        add_bos_token=bool(cfg.get("add_bos_token", False)) and not backend_adds_bos,
        eos_token_ids=tuple(eos_ids),
        special_ids=frozenset(i for i, t in added.items() if getattr(t, "special", False)),
    )


def load_tokenizer(model: str | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file or HF folder; the default model's when None."""
    from quantpipe.runtime.model.loader import resolve_model_path

    path = resolve_model_path(model)
    st = os.stat(path)
    return _load_tokenizer(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, mtime_ns: int, size: int) -> Tokenizer:
    # Building the BPE model from a 49k-token vocabulary takes about half a second; stages
    # that need only the tokenizer reuse one per file version.
    if path.endswith(".gguf"):
        from quantpipe.runtime.model.gguf_file import read_gguf

        return tokenizer_from_gguf(read_gguf(path))
    return tokenizer_from_hf(path)
