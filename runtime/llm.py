"""LLM: offline batch generation, shaped like vLLM's."""

from __future__ import annotations

from typing import Sequence

from quantpipe.runtime.llm_engine import EngineArgs, LLMEngine
from quantpipe.runtime.outputs import RequestOutput
from quantpipe.runtime.sampling_params import SamplingParams


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: str | int | float | None = None,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        seed: int = 0,
        device: str = "auto",
        max_model_len: int | None = None,
        disable_cpu_kernels: Sequence[str] | str = (),
    ):
        self.engine = LLMEngine(
            EngineArgs(
                model=model, dtype=dtype, device=device, block_size=block_size, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching, seed=seed,
                disable_cpu_kernels=disable_cpu_kernels,
            )
        )

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            raise ValueError("prompts must be a string, a list of strings or a list of token-id lists")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        ids = []
        try:
            # Validate and queue everything first, so a bad prompt leaves nothing behind.
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat() needs a tokenizer with a chat template")
        prompts = [tok.apply_chat_template(conv, add_generation_prompt) for conv in conversations]
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return [done[i] for i in ids]
