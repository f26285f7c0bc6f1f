"""Gemma 3 270M's real weights (the gemma3-270m package's Q4_K_M GGUF) against HF transformers,
which reads the same GGUF with its own dequantization and tokenizer conversion."""

import pytest
import torch

from quantpipe.runtime import LLM, SamplingParams
from quantpipe.runtime.model.loader import resolve_model_path
from quantpipe.runtime.model.tokenizer import load_tokenizer
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def gguf():
    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def hf_model(gguf):
    import os

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine's requests ignore EOS too
    return model


def test_tokenizer_matches_hf(gguf, corpus_prompts):
    import os

    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    ours = load_tokenizer("gemma3-270m")
    texts = corpus_prompts[:40] + [
        "Hello world, this is  a test.\n  ok 12345 émoji 🤗 日本語のテキスト",
        "\t\tdef f(x):\n\n\n    return x  + 1<start_of_turn>user\nhi<end_of_turn>\n</s>",
        "   leading spaces, trailing ones   ", "<0x41> <unused0> [multimodal] ▁literal",
    ]
    for text in texts:
        assert ours.encode(text) == ref(text).input_ids, text[:80]
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == 2 and ours.eos_token_ids[:2] == (1, 106)  # <eos>, <end_of_turn>


def test_greedy_matches_hf_past_the_sliding_window(gguf, hf_model, corpus_prompts):
    """float32 greedy tokens equal HF's, on prompts shorter than the 512-token window and
    longer than it (so local layers' windows slide in prefill and in decode), prefilled in
    128-token chunks."""
    tok = load_tokenizer("gemma3-270m")
    long = tok.encode(" ".join(corpus_prompts[:8]))[:600]
    prompts = [tok.encode(corpus_prompts[9])[:20], tok.encode(corpus_prompts[10])[:300], long[:505], long]
    outs = [24, 16, 24, 16]
    ref = hf_greedy(hf_model, prompts, outs)
    llm = LLM(model=gguf, dtype="float32", device="cpu", max_num_batched_tokens=128)
    got = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs])
    assert [r.outputs[0].token_ids for r in got] == ref


def test_gemma_gguf_without_a_template_gets_gemmas_turn_format():
    tok = load_tokenizer("gemma3-270m")
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode(text)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1  # one BOS, turn markers as single tokens
    with pytest.raises(ValueError, match="alternate user and assistant"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
