"""Checkpoints written by llm-compressor itself load and run in the runtime.

tests/fixtures/llmcompressor holds a small random Llama quantized by llmcompressor
0.14.0.1 with its own presets (W4A16, W4A16_ASYM, W8A16, W8A8) and by its GPTQModifier
with a static FP8 KV cache; each folder also holds llm-compressor's logits for fixed
ids, from its fake-quantized model in memory (scripts/make-llmcompressor-fixtures.py
wrote them). The runtime's logits must equal those on every kernel path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantpipe.runtime import LLM, SamplingParams
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llmcompressor"
NAMES = ["w4a16", "w4a16-asym", "w8a16", "w8a8", "w4a16-gptq-kv-fp8"]


@pytest.mark.parametrize("name", NAMES)
def test_llmcompressor_checkpoint_matches_its_own_logits(name):
    folder = str(FIXTURES / name)
    ref = torch.load(FIXTURES / name / "reference.pt")
    bf16, _, _ = load_model(folder, torch.bfloat16)  # the format picks the kernel for bf16 activations
    (fast,) = {type(m).kernel for m in bf16.modules() if hasattr(m, "kernel")}
    # llm-compressor's W8A16 preset is group 128: torch has no grouped int8 kernel, so it runs
    # quantpipe's packed float32 kernel, its weights still one byte each.
    assert fast == {"w4a16": "int4pack", "w4a16-asym": "int4pack", "w8a16": "packed-f32", "w8a8": "w8a8",
                    "w4a16-gptq-kv-fp8": "int4pack"}[name]
    for force in {fast, "dequant", "packed-f32"}:  # checked in float32 on each path
        model, _, _ = load_model(folder, torch.float32, quant_kernel=force)
        got = sequence_logits(model, ref["ids"])
        # Identical arithmetic up to float32 summation order (W8A8: integer matmul vs float).
        assert torch.allclose(got, ref["logits"], atol=2e-2 if name == "w8a8" else 1e-4), \
            (force, (got - ref["logits"]).abs().max())
    if name.endswith("kv-fp8"):  # the static per-tensor KV scales are used, not dropped
        assert model.kv_cache_dtype == "fp8" and model.layers[0].self_attn.kv_scales is not None
        model.kv_cache_dtype = "auto"
        assert not torch.allclose(sequence_logits(model, ref["ids"]), ref["logits"], atol=1e-2)
    llm = LLM(model=folder, dtype="float32", kv_cache_memory="4MiB")
    out = llm.generate([ref["ids"]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.outputs[0].token_ids[0] == int(ref["logits"][-1].argmax())
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
