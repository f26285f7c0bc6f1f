"""OpenAI request -> engine request, engine outputs -> OpenAI responses and SSE chunks.

`prepare_*` do everything that can fail with a 4xx (model name, prompt shape,
tokenization, context and KV limits, sampling bounds) before a request costs any
compute. `Responder` turns the cumulative RequestOutputs of one request into a
response body, or a stream of chunk dicts, for either endpoint.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from quantpipe.runtime.llm_engine import LLMEngine
from quantpipe.runtime.outputs import Logprob, RequestOutput
from quantpipe.runtime.sampling_params import SamplingParams
from quantpipe.runtime.server.errors import APIError, param_of
from quantpipe.runtime.server.protocol import ChatMessage, ChatRequest, CompletionRequest, SamplingFields
from quantpipe.runtime.server.stream import TextDeltas

# Tokenize off the event loop above this many characters, so a huge prompt never
# stalls /health; below it, a thread hop costs more than the encode itself.
_OFFLOOP_CHARS = 8192
_NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM uses the same stand-in
_MAX_PROMPTS = 256  # prompts in one completions request: each is an engine request of its own


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code, reason="bad_request")


@dataclass
class Prepared:
    """A validated request, ready to hand to the engine."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-N; None: no logprobs in the response
    priority: int
    echo: str | None = None  # completions' echo: the prompt's text, returned before the output

    @property
    def cost_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


class Preparer:
    def __init__(self, engine: LLMEngine, model_names: list[str]):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_names = model_names
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.max_model_len
        self.kv_tokens = engine.pool.num_blocks * engine.pool.block_size

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves {self.model_names[0]!r}",
                           param="model", code="model_not_found", reason="bad_request")
        return self.model_names[0]

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")  # JSON escapes can smuggle in lone surrogates, which the tokenizer rejects
        except UnicodeEncodeError:
            raise bad(f"{param} is not valid Unicode (a lone surrogate escape such as \\ud800)", param) from None
        if len(text) > _OFFLOOP_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    def tokenizer_info(self) -> dict:
        """The special tokens, chat template and context of this model's tokenizer (vLLM's
        /tokenizer_info; None where the model has no such token)."""
        tok = self.tokenizer

        def name(token_id: int | None) -> str | None:
            return tok.id_to_token(token_id) if token_id is not None else None

        eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_token_id),
                "eos_token": name(eos), "pad_token": name(eos), "add_bos_token": tok.add_bos_token,
                "chat_template": tok.chat_template, "model_max_length": self.max_model_len,
                "vocab_size": self.vocab_size}

    def chat_text(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise bad("this model has no chat template; use /v1/completions", "messages")
        plain = []
        for m in messages:
            if isinstance(m.content, list):
                content = "".join(p.text for p in m.content)
            else:
                content = m.content or ""
            role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
            plain.append({"role": role, "content": content})
        try:
            return self.tokenizer.apply_chat_template(plain, add_generation_prompt)
        except Exception as e:  # the template's own raise_exception, or any Jinja error: the input's fault
            raise bad(f"messages: the chat template failed: {e}", "messages") from None

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        over = [t for t in ids if t >= self.vocab_size]
        if over:
            raise bad(f"{param} token ids must be < the vocabulary size {self.vocab_size}, got {over[:5]}", param)

    async def completion(self, req: CompletionRequest) -> list[Prepared]:
        """One engine request per prompt: `prompt` may be a list of them (strings or token-id
        lists), answered as one response whose choices are in the prompts' order."""
        p = req.prompt
        prompts = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(prompts) > _MAX_PROMPTS:
            raise bad(f"prompt: at most {_MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
        if len(prompts) > 1 and req.stream:
            raise bad("stream: true takes one prompt per request; send the others separately", "stream")
        out = []
        for i, one in enumerate(prompts):
            try:
                out.append(await self._completion(req, one))
            except APIError as e:
                if len(prompts) > 1:  # say which prompt
                    e.message = f"prompt[{i}]: {e.message}"
                raise
        return out

    async def _completion(self, req: CompletionRequest, p) -> Prepared:
        model = self.check_model(req.model)
        if req.best_of not in (None, 1):
            raise bad("best_of must be 1 (parallel sampling is not supported)", "best_of")
        if isinstance(p, str):
            if self.tokenizer is None:
                raise bad("this model has no tokenizer: send prompt token ids", "prompt")
            ids = await self.encode(p)
        else:
            ids = list(p)
            self.check_ids(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's and vLLM's default
        prep = self._finish(req, "completion", model, ids, max_tokens, req.logprobs, explicit_max=True)
        if req.echo:  # the prompt comes back first, with its logprobs when logprobs are asked for
            if self.tokenizer is None:
                raise bad("echo needs a tokenizer to return the prompt's text; this model has none", "echo")
            prep.echo = p if isinstance(p, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
            prep.params.prompt_logprobs = req.logprobs
        return prep

    async def chat(self, req: ChatRequest) -> list[Prepared]:
        return [await self._chat(req)]

    async def _chat(self, req: ChatRequest) -> Prepared:
        model = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        text = self.chat_text(req.messages, req.add_generation_prompt)
        ids = await self.encode(text, "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self._finish(req, "chat", model, ids, max_tokens, logprobs, explicit_max=max_tokens is not None)

    def _finish(self, req: SamplingFields, kind: str, model: str, ids: list[int], max_tokens: int | None,
                logprobs: int | None, explicit_max: bool) -> Prepared:
        if req.n != 1:
            raise bad(f"n must be 1 (parallel sampling is not supported), got {req.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) not in (None, 0, 0.0):
                raise bad(f"{name} is not supported (only 0)", name)
        if req.stream_options is not None and not req.stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        n = len(ids)
        ctx = self.max_model_len
        if n == 0:
            raise bad("prompt must not be empty", "prompt" if kind == "completion" else "messages")
        if n >= ctx:
            raise bad(f"the prompt has {n} tokens; the context holds {ctx} (max_model_len), "
                      f"which must leave room for at least one output token",
                      "prompt" if kind == "completion" else "messages", "context_length_exceeded")
        if max_tokens is None:
            max_tokens = ctx - n  # the rest of the context, as vLLM does
        elif n + max_tokens > ctx:
            param = "max_tokens" if kind == "completion" or req.max_completion_tokens is None \
                else "max_completion_tokens"
            raise bad(f"max_tokens={max_tokens} with a {n}-token prompt exceeds the context of {ctx} tokens "
                      f"(max_model_len); at most {ctx - n}", param, "context_length_exceeded")
        if n + max_tokens > self.kv_tokens:
            if explicit_max:
                raise bad(f"prompt + max_tokens = {n + max_tokens} tokens does not fit the KV cache "
                          f"({self.kv_tokens} tokens)", "max_tokens")
            max_tokens = self.kv_tokens - n  # an implicit default shrinks to what fits
            if max_tokens < 1:
                raise bad(f"the prompt has {n} tokens; the KV cache holds {self.kv_tokens}", "prompt")
        if req.stop_token_ids:
            self.check_ids(req.stop_token_ids, "stop_token_ids")
        try:
            params = SamplingParams(
                n=1, max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p),
                top_k=0 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else float(req.min_p),
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as e:
            raise bad(str(e), param_of(str(e))) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Prepared(kind, model, ids, params, req.stream, include_usage, logprobs, req.priority)


def _lp(x: float) -> float:
    return x if x > -1e30 else _NEG_INF_LOGPROB  # also maps -inf


@dataclass
class Responder:
    """Builds one request's response (whole, or chunk by chunk) from cumulative outputs."""

    prep: Prepared
    request_id: str
    tokenizer: object
    created: int = field(default_factory=lambda: int(time.time()))
    _deltas: TextDeltas | None = None
    _whole: bool = False  # the whole response body was built (non-streaming)
    delivered_finish_reason: str | None = None  # set once the final chunk or body was built
    _lp_sent: int = 0  # output tokens whose logprobs were already streamed
    _text_offset: int = 0  # completions logprobs: characters before the next token
    _echo_sent: bool = False  # a stream's echoed prompt went out

    def __post_init__(self) -> None:
        self._deltas = TextDeltas(list(self.prep.params.stop))

    @property
    def chat(self) -> bool:
        return self.prep.kind == "chat"

    def delivered_text(self, out: RequestOutput | None) -> str:
        """What the client was handed: the whole text, or the streamed prefix of it."""
        if out is None:
            return ""
        text = out.outputs[0].text
        return text if self._whole else text[: self._deltas.sent]

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self, out: RequestOutput) -> dict:
        p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # -- logprobs -----------------------------------------------------------------------

    def _top(self, lp: Logprob) -> list[tuple[str, float]]:
        """The requested number of alternatives, most likely first, as (token text, logprob)."""
        best = sorted(lp.top_logprobs.items(), key=lambda kv: -kv[1])[: self.prep.logprobs]
        return [(self._token_str(i), _lp(v)) for i, v in best]

    def _logprobs(self, token_ids: list[int], lps: list[Logprob | None]) -> dict | None:
        if self.prep.logprobs is None:
            return None
        if self.chat:
            content = []
            for tid, lp in zip(token_ids, lps):
                s = self._token_str(tid)
                top = [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in self._top(lp)]
                content.append({"token": s, "logprob": _lp(lp.logprob), "bytes": list(s.encode()),
                                "top_logprobs": top})
            return {"content": content}
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in zip(token_ids, lps):
            s = self._token_str(tid)
            tokens.append(s)
            token_lps.append(None if lp is None else _lp(lp.logprob))  # None: the prompt's first token
            tops.append(None if lp is None else dict(self._top(lp)))
            offsets.append(self._text_offset)
            self._text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _new_logprobs(self, out: RequestOutput) -> dict | None:
        c = out.outputs[0]
        if self.prep.logprobs is None or c.logprobs is None:
            return None
        start, self._lp_sent = self._lp_sent, len(c.logprobs)
        return self._logprobs(c.token_ids[start:], c.logprobs[start:])

    def _echo(self, out: RequestOutput) -> tuple[str, dict | None]:
        """Completions' echo: the prompt's text and, when logprobs are asked for, its tokens'
        logprobs; the output's text offsets then count from the end of the prompt's text."""
        lps = self._logprobs(out.prompt_token_ids, out.prompt_logprobs) if self.prep.logprobs is not None else None
        self._text_offset = len(self.prep.echo)
        return self.prep.echo, lps

    @staticmethod
    def _join(first: dict | None, then: dict | None) -> dict | None:
        return first if then is None else then if first is None else {k: first[k] + then[k] for k in first}

    # -- whole responses ----------------------------------------------------------------

    def response(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        self._whole, self.delivered_finish_reason = True, c.finish_reason
        echo, echo_lps = self._echo(out) if self.prep.echo is not None else ("", None)
        logprobs = self._logprobs(c.token_ids, c.logprobs or []) if self.prep.logprobs is not None else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": echo + c.text, "logprobs": self._join(echo_lps, logprobs),
                      "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.prep.model,
                "choices": [choice], "usage": self.usage(out)}

    # -- streaming ----------------------------------------------------------------------

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        d = {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
             "created": self.created, "model": self.prep.model, "choices": choices}
        if self.prep.include_usage:
            d["usage"] = usage  # null on every chunk but the last, as OpenAI does
        return d

    def first_chunks(self) -> list[dict]:
        if self.chat:  # OpenAI opens a chat stream with the role
            return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])]
        return []

    def chunks(self, out: RequestOutput) -> list[dict]:
        """Chunks for one (cumulative) output; the last ones when it finished."""
        c = out.outputs[0]
        piece = self._deltas.delta(c.text, out.finished)
        if out.finished:
            self.delivered_finish_reason = c.finish_reason
        echo, echo_lps = "", None
        if self.prep.echo is not None and not self._echo_sent:  # the first chunk carries the prompt
            self._echo_sent = True
            echo, echo_lps = self._echo(out)
        logprobs = self._join(echo_lps, self._new_logprobs(out))
        piece = echo + piece
        if not piece and logprobs is None and not out.finished:
            return []
        finish = c.finish_reason if out.finished else None
        if self.chat:
            delta = {"content": piece} if piece or not out.finished else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish}
        if out.finished:
            choice["stop_reason"] = c.stop_reason
        result = [self._chunk([choice])]
        if out.finished and self.prep.include_usage:
            result.append(self._chunk([], self.usage(out)))
        return result
