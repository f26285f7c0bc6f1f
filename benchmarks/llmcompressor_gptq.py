"""llm-compressor's GPTQModifier on given token ids; runs in llm-compressor's own virtualenv.

    LC/bin/python benchmarks/llmcompressor_gptq.py HF_MODEL_DIR SAMPLES.json OUT_DIR \
        [--group-size 64] [--observer imatrix_mse]

SAMPLES.json is a list of token-id lists (what benchmarks/bench_vs_llmcompressor.py
writes: the same sequences quantpipe's GPTQ calibrates on). W4A16, symmetric, the given
group size, dampening 0.01, lm_head left out; everything else llm-compressor's defaults.
`--observer imatrix_mse` is llm-compressor's importance-weighted range search: the observer
collects E[x^2] per input channel from GPTQ's own calibration forwards, and each group's
range is the one with the least importance-weighted error (its README's best W4A16 recipe
with GPTQ; in 0.14.0.1 the observer hooks the Linear itself, no gatherer modifier).
Writes the compressed checkpoint to OUT_DIR and prints one JSON line with the time taken.
"""

import argparse
import json
import time

import torch
import transformers
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("samples")
    ap.add_argument("out")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--observer", choices=("default", "imatrix_mse"), default="default",
                    help="the weights' observer; default: llm-compressor's own (min-max)")
    args = ap.parse_args()
    rows = json.load(open(args.samples))
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": args.group_size}
    if args.observer == "imatrix_mse":
        weights["observer"] = "imatrix_mse"
    recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                          ignore=["lm_head"], dampening_frac=0.01)
    t = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, processor=tokenizer, num_calibration_samples=len(rows),
            max_seq_length=max(len(r) for r in rows))
    took = time.perf_counter() - t
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(json.dumps({"llmcompressor_gptq_s": round(took, 1), "observer": args.observer, "samples": len(rows),
                      "tokens": sum(len(r) for r in rows)}), flush=True)


if __name__ == "__main__":
    main()
