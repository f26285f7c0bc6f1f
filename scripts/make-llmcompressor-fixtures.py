"""Write the llm-compressor artifacts that tests/model/test_llmcompressor_artifacts.py loads.

Run in a virtualenv of its own (llmcompressor pins transformers and compressed-tensors
versions other than quantpipe's):

    bash scripts/setup-anchors   # .anchors/llmcompressor: llmcompressor 0.14.0.1, torch 2.13.0
    .anchors/llmcompressor/bin/python scripts/make-llmcompressor-fixtures.py tests/fixtures/llmcompressor

A small random Llama (seeded) is quantized with llm-compressor's own presets: W4A16
(group 128), W4A16_ASYM, W8A16 and W8A8 data-free, and W4A16 through GPTQModifier with an
FP8 KV cache on random token ids. Each folder holds what `save_pretrained(...,
save_compressed=True)` wrote, plus `reference.pt`: the float32 logits on fixed ids of
llm-compressor's own quantized model in memory (fake-quantized weights, activations
and KV cache, as its scheme says), taken before saving.
"""

import shutil
import sys
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

IDS = [3, 17, 125, 99, 4, 4, 120, 100, 7, 64, 12, 100, 31, 9, 50, 42]


def base_model(folder: Path):
    """The random model, saved and loaded back (oneshot reads the model's config from its folder)."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def tokenizer():
    """A word-level tokenizer over the 128 ids: llm-compressor wants a processor beside a dataset."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(128)}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                                unk_token="t0", pad_token="t0")


def calibration():
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 128, (64,), generator=g).tolist() for _ in range(32)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 64 for _ in rows]})


RECIPES = {
    "w4a16": lambda: QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
    "w4a16-asym": lambda: QuantizationModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"]),
    "w8a16": lambda: QuantizationModifier(targets="Linear", scheme="W8A16", ignore=["lm_head"]),
    "w8a8": lambda: QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    "w4a16-gptq-kv-fp8": lambda: GPTQModifier(
        targets="Linear", scheme="W4A16", ignore=["lm_head"],
        kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}),
}


def main(out: str) -> None:
    root = Path(out)
    for name, recipe in RECIPES.items():
        model = base_model(root / ".base")
        kw = {"dataset": calibration(), "num_calibration_samples": 32, "max_seq_length": 64,
              "processor": tokenizer()} if "gptq" in name else {}
        oneshot(model=model, recipe=recipe(), **kw)
        with torch.no_grad():
            logits = model(torch.tensor([IDS])).logits[0].float()
        dst = root / name
        shutil.rmtree(dst, ignore_errors=True)
        model.save_pretrained(dst, save_compressed=True)
        torch.save({"ids": IDS, "logits": logits}, dst / "reference.pt")
        print(name, sorted(p.name for p in dst.iterdir()))
    shutil.rmtree(root / ".base")


if __name__ == "__main__":
    main(sys.argv[1])
