"""LLMEngine: tokenizer + scheduler + model runner, one step at a time."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from quantpipe.runtime.engine.block_pool import BlockPool
from quantpipe.runtime.engine.request import Request
from quantpipe.runtime.engine.scheduler import Scheduler, SchedulerConfig
from quantpipe.runtime.model.cpu_kernels import CpuKernels
from quantpipe.runtime.model.kv_cache import check_kv_cache_dtype
from quantpipe.runtime.model.loader import load_model
from quantpipe.runtime.model.runner import ModelRunner
from quantpipe.runtime.model.sampler import SamplingRow, sample, token_logprobs
from quantpipe.runtime.model.tokenizer import IncrementalDetokenizer
from quantpipe.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from quantpipe.runtime.sampling_params import SamplingParams
from quantpipe.runtime.utils import available_memory_bytes, format_bytes, parse_bytes

log = logging.getLogger("quantpipe")


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: str | int | float | None = None  # bytes ("2GiB") or a fraction of free memory
    # "auto": the artifact's kv_cache_scheme if it has one, else the model dtype; "int8"/"fp8" override it
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    seed: int = 0
    # the runtime's own CPU kernels to turn off (names in runtime/model/cpu_kernels.py, or a
    # comma-separated string): their layers take torch's path, for measuring and working round
    disable_cpu_kernels: tuple[str, ...] | str = ()


def _cuda_plan(model: str | None, device: torch.device):
    """The Triton kernel plan a quantized artifact recorded for this GPU, or None."""
    try:
        from quantpipe.kernels.plan import plan_for
    except ImportError as e:
        log.warning("quantized layers use the torch fallback: quantpipe.kernels is not importable (%s)", e)
        return None
    return plan_for(model, device)


def _cuda_decode_kernel(model, block_size: int):
    """quantpipe.kernels' paged decode for this model's KV cache, or None (said why)."""
    try:
        from quantpipe.kernels.paged_attention import decode_kernel_for
    except ImportError as e:
        log.warning("decode attention uses gather + GEMMs: triton is not importable (%s)", e)
        return None
    return decode_kernel_for(model, block_size)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        # bf16 on CPU only pays off with native bf16 instructions (AVX-512 BF16 / AMX).
        bf16_ok = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        return torch.bfloat16 if bf16_ok else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
    if device.type == "cpu" and dtype == "float16":
        raise ValueError("dtype float16 is not supported on CPU; use bfloat16 or float32")
    return names[dtype]


@dataclass
class _Tracked:
    """Engine-side state of a request beyond what the scheduler needs."""

    req: Request
    params: SamplingParams
    prompt: str | None
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None
    logprobs: list[Logprob] | None
    prompt_logprobs: list[Logprob | None] | None = None  # filled as the prompt's chunks run
    stop_reason: str | int | None = None


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, clock: Callable[[], float] = time.monotonic, **kwargs):
        args = args or EngineArgs(**kwargs)
        self.args = args
        self.clock = clock
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        if args.block_size < 1 or args.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {args.block_size}")
        check_kv_cache_dtype(args.kv_cache_dtype)
        self.cpu_kernels = CpuKernels.parse(args.disable_cpu_kernels)
        cuda = self.device.type == "cuda"
        model, self.model_config, self.tokenizer = load_model(args.model, self.dtype, self.device,
                                                              kernel_plan=_cuda_plan(args.model, self.device)
                                                              if cuda else None, cpu_kernels=self.cpu_kernels)
        model.to(self.device)
        if args.kv_cache_dtype != "auto":  # asked for explicitly: dynamic scales, whatever the artifact says
            model.kv_cache_dtype = args.kv_cache_dtype
            for layer in model.layers:
                layer.self_attn.kv_scales = None
        self.kv_cache_dtype = model.kv_cache_dtype
        static = model.layers[0].self_attn.kv_scales is not None
        cfg = self.model_config
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be <= the model's context ({cfg.max_position_embeddings}), got {self.max_model_len}"
            )
        per_block = ModelRunner.kv_bytes_per_block(cfg, args.block_size, self.dtype, self.kv_cache_dtype, static)
        budget = self._kv_budget(args.kv_cache_memory)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={args.kv_cache_memory!r} is smaller than one KV block ({per_block} bytes)"
            )
        self.kv_cache_bytes = num_blocks * per_block
        self.pool = BlockPool(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len), self.pool
        )
        self.runner = ModelRunner(model, num_blocks, args.block_size, self.device, self.dtype, self.cpu_kernels,
                                  _cuda_decode_kernel(model, args.block_size) if cuda else None)
        self.generator = torch.Generator().manual_seed(args.seed)
        self.tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "batched_tokens": 0}
        plain = ModelRunner.kv_bytes_per_block(cfg, args.block_size, self.dtype)
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens, %s (%s, %s)%s",
            num_blocks, args.block_size, num_blocks * args.block_size, format_bytes(self.kv_cache_bytes),
            self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype + (" static" if static else ""),
            self.device,
            "" if self.kv_cache_dtype == "auto" else f"; {plain / per_block:.2f}x the tokens of a {self.dtype} cache",
        )

    def _kv_budget(self, value) -> int:
        if value is None:  # CPU: a quarter of free memory, at most 4 GiB; CUDA: 90% of what is free
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                return int(free * 0.9)
            return min(4 * 2**30, available_memory_bytes() // 4)
        if isinstance(value, float) and 0 < value <= 1:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
            else:
                free = available_memory_bytes()
            return int(free * value)
        return parse_bytes(value, "kv_cache_memory")

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        params = params or SamplingParams()
        params.validate()
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the context holds {self.max_model_len} (max_model_len)")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={max_tokens} with a {n}-token prompt exceeds the context of {self.max_model_len} "
                f"tokens (max_model_len); at most {self.max_model_len - n}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model was loaded without one")
        vocab_ids = [t for t in params.stop_token_ids if t >= vocab]
        if vocab_ids:
            raise ValueError(f"stop_token_ids must be < vocab size {vocab}, got {vocab_ids}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            max_tokens=max_tokens,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority,
        )
        # Prompt logprobs need every prompt position computed: no cached prefix until they are in.
        req.read_prefix_cache = params.prompt_logprobs is None or n == 1
        self.scheduler.add(req)  # raises if the KV cache could never hold it
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
        self.tracked[request_id] = _Tracked(
            req, params, prompt_text, detok, generator, [] if params.logprobs is not None else None,
            [None] if params.prompt_logprobs is not None else None,
        )
        return request_id

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model was loaded without a tokenizer: pass prompt token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        t = self.tracked.pop(request_id, None)
        if t is None:
            return None
        self.scheduler.finish(t.req, "abort", self.clock())
        return self._output(t)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, execute and sample once; outputs for every request that advanced."""
        now = self.clock()
        sched = self.scheduler.schedule(now)
        if not sched:
            return []
        # Only a chunk inside the prompt can owe prompt logprobs: decodes skip the lookup.
        prompt_rows = [span for c in sched.chunks if c.start < c.request.num_prompt_tokens - 1
                       and (span := self._prompt_rows(c)) is not None]
        sampled_chunks, logits = self.runner.execute(sched.chunks, prompt_rows)
        if prompt_rows:
            self._add_prompt_logprobs(prompt_rows, logits[len(sampled_chunks):])
            logits = logits[:len(sampled_chunks)]
        self.scheduler.update_after_step(sched)
        self.stats["steps"] += 1
        self.stats["batched_tokens"] += sched.num_batched_tokens
        self.stats["prompt_tokens"] += sum(
            max(0, min(c.end, c.request.num_prompt_tokens) - c.start) for c in sched.chunks
        )
        rows = [self._sampling_row(self.tracked[c.request.request_id]) for c in sampled_chunks]
        results = sample(logits, rows, self.generator) if rows else []
        now = self.clock()
        outputs = []
        for chunk, res in zip(sampled_chunks, results):
            t = self.tracked[chunk.request.request_id]
            self._append(t, res, now)
            outputs.append(self._output(t))
            if t.req.is_finished:
                del self.tracked[t.req.request_id]
        self.stats["generation_tokens"] += len(results)
        return outputs

    def _prompt_rows(self, chunk) -> tuple | None:
        """(chunk, a, b): the positions of this chunk whose logits give prompt logprobs still
        owed (position q scores prompt token q + 1), or None."""
        t = self.tracked[chunk.request.request_id]
        if t.prompt_logprobs is None:
            return None
        a = max(chunk.start, len(t.prompt_logprobs) - 1)  # a recompute after preemption adds nothing twice
        b = min(chunk.end, chunk.request.num_prompt_tokens - 1)
        return (chunk, a, b) if a < b else None

    def _add_prompt_logprobs(self, spans: list[tuple], logits: torch.Tensor) -> None:
        row = 0
        for chunk, a, b in spans:
            t = self.tracked[chunk.request.request_id]
            picked = token_logprobs(logits[row:row + b - a], chunk.request.prompt_token_ids[a + 1:b + 1],
                                    t.params.prompt_logprobs)
            t.prompt_logprobs.extend(Logprob(lp, top) for lp, top in picked)
            row += b - a
            if len(t.prompt_logprobs) == chunk.request.num_prompt_tokens:
                chunk.request.read_prefix_cache = True

    def _sampling_row(self, t: _Tracked) -> SamplingRow:
        p = t.params
        banned = []
        if t.req.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.model_config.eos_token_ids))
        return SamplingRow(p.temperature, p.top_k, p.top_p, p.min_p, t.generator, banned, p.logprobs)

    def _append(self, t: _Tracked, res, now: float) -> None:
        req, p = t.req, t.params
        self.scheduler.append_token(req, res.token_id)
        if req.first_token_time is None:
            req.first_token_time = now
        if t.logprobs is not None:
            t.logprobs.append(Logprob(res.logprob, res.top_logprobs or {}))
        tok = res.token_id
        reason = None
        if t.detok is not None:
            t.detok.add(tok)
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in self.model_config.eos_token_ids:
                reason = "stop"
            elif tok in p.stop_token_ids:
                reason, t.stop_reason = "stop", tok
            elif p.stop and t.detok is not None:
                # Only the newest text can complete a stop string.
                tail_from = max(0, len(t.detok.text) - max(map(len, p.stop)) - 16)
                hits = [(t.detok.text.find(s, tail_from), s) for s in p.stop]
                hits = [h for h in hits if h[0] >= 0]
                if hits:
                    pos, s = min(hits)
                    t.detok.text = t.detok.text[:pos]
                    reason, t.stop_reason = "stop", s
        if reason is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason, now)

    def _output(self, t: _Tracked) -> RequestOutput:
        req = t.req
        text = t.detok.text if t.detok is not None else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=t.stop_reason,
            logprobs=list(t.logprobs) if t.logprobs is not None else None,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
        )
        return RequestOutput(req.request_id, t.prompt, list(req.prompt_token_ids), [completion], req.is_finished,
                             metrics, t.prompt_logprobs)  # complete before any output; never changed after
