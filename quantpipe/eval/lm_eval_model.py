"""quantpipe's runtime as an lm-evaluation-harness model, registered as `quantpipe`:

    quantpipe lm-eval --model quantpipe --model_args pretrained=ARTIFACT,dtype=float32 --tasks ...

`pretrained` is anything the runtime loads (a quantized artifact, an HF folder, a GGUF
file; empty: the default model). Log-likelihoods are scored as `quantpipe eval` scores
its multiple-choice items (`quantpipe.eval.mc.loglikelihoods`: float32 by default, one
context at a time with all its continuations, batch-invariant), so the same items give
the same accuracies either way; generation runs on the paged engine (`LLM`, greedy).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import lm_eval.models  # noqa: F401 - lm-eval's own models; imported first, or registering ours hides them
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from quantpipe.eval.mc import loglikelihoods, token_loglikelihoods
from quantpipe.runtime.model.loader import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
log = logging.getLogger("quantpipe.eval")


@register_model("quantpipe")
class QuantpipeLM(LM):
    def __init__(self, pretrained: str | None = None, dtype: str = "float32", max_length: int | None = None,
                 device: str | None = None, batch_size: int | str | None = None, max_batch_size: int | None = None,
                 **unknown) -> None:
        super().__init__()
        if unknown:
            raise ValueError(f"--model_args: quantpipe takes pretrained, dtype, max_length; got {sorted(unknown)}")
        if dtype not in DTYPES:
            raise ValueError(f"--model_args dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
        # lm-eval passes its --device (cuda:0 unless told otherwise); as its HF model does,
        # a CUDA device that is not there falls back to the CPU, with a warning.
        dev = torch.device(device or "cpu")
        if dev.type == "cuda" and not torch.cuda.is_available():
            log.warning("--device %s: no CUDA device here, scoring on the CPU", device)
            dev = torch.device("cpu")
        model, _, tokenizer = load_model(pretrained or None, DTYPES[dtype], dev)
        if tokenizer is None:
            raise ValueError(f"--model_args pretrained={pretrained}: the model folder has no tokenizer.json")
        self._attach(model.to(dev), tokenizer, pretrained, dtype, max_length)

    @classmethod
    def from_loaded(cls, model, tokenizer, pretrained: str | None, dtype: str = "float32") -> QuantpipeLM:
        """The LM over a model the caller has already loaded (`quantpipe eval` scores the
        models it holds); `pretrained` is what generation's engine loads, if a task generates."""
        lm = cls.__new__(cls)
        LM.__init__(lm)
        lm._attach(model, tokenizer, pretrained, dtype, None)
        return lm

    def _attach(self, model, tokenizer, pretrained: str | None, dtype: str, max_length: int | None) -> None:
        self.model, self.tokenizer, self.pretrained, self.dtype = model, tokenizer, pretrained or None, dtype
        self.max_length = int(max_length or model.config.max_position_embeddings)
        self._llm = None

    @property
    def prefix_token_id(self) -> int:
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_ids[0]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        by_context: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, continuation = req.args
            by_context[context].append((i, continuation))
        out: list = [None] * len(requests)
        for context, members in by_context.items():
            results = loglikelihoods(self.model, self.tokenizer, context, [c for _, c in members])
            for (i, _), res in zip(members, results):
                out[i] = res
                self.cache_hook.add_partial("loglikelihood", requests[i].args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            windows = get_rolling_token_windows(ids, prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            total = sum(token_loglikelihoods(self.model, context, [target])[0][0]
                        for context, target in map(make_disjoint_window, windows))
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from quantpipe.runtime import LLM, SamplingParams

        if self._llm is None:
            self._llm = LLM(model=self.pretrained, dtype=self.dtype, device=next(self.model.parameters()).device.type)
        prompts, params = [], []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            if kwargs.pop("do_sample", False) or kwargs.get("temperature", 0.0):
                raise ValueError("quantpipe's lm-eval model generates greedily: do_sample and temperature "
                                 "other than 0 are not supported")
            prompts.append(self.tokenizer.encode(context))
            params.append(SamplingParams(temperature=0.0, max_tokens=max_new, stop=until))
        texts = [r.outputs[0].text for r in self._llm.generate(prompts, params)]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts
