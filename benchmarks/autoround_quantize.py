"""auto-round's own quantizer (AutoRound, sign-gradient rounding) on given token ids; runs in
auto-round's own virtualenv (`bash scripts/setup-anchors` makes .anchors/auto-round).

    .anchors/auto-round/bin/python benchmarks/autoround_quantize.py HF_MODEL_DIR SAMPLES.json OUT_DIR \
        [--group-size 64] [--iters 200]

SAMPLES.json is a list of token-id lists, all of one length (auto-round skips a sequence
shorter than its `seqlen`; benchmarks/bench_vs_llmcompressor.py `--same-length` cuts them).
W4A16, symmetric, the given group size, lm_head left out; everything else auto-round's
defaults (200 iterations per decoder layer, batches of 8). Writes a compressed-tensors
checkpoint (its `llm_compressor` format) to OUT_DIR and prints one JSON line with the
time taken.
"""

import argparse
import glob
import json
import os
import shutil
import time

import torch
import transformers
from auto_round import AutoRound


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("samples")
    ap.add_argument("out")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    rows = json.load(open(args.samples))
    lengths = {len(r) for r in rows}
    if len(lengths) != 1:
        raise SystemExit(f"{args.samples}: sequences of {len(lengths)} lengths; auto-round needs one")
    seqlen = lengths.pop()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    ar = AutoRound(model, scheme="W4A16", tokenizer=tokenizer, dataset=[torch.tensor([r]) for r in rows],
                   iters=args.iters, nsamples=len(rows), seqlen=seqlen, group_size=args.group_size, sym=True,
                   device_map="cpu")
    t = time.perf_counter()
    ar.quantize_and_save(args.out + ".tmp", format="llm_compressor")
    took = time.perf_counter() - t
    # It writes the checkpoint into a subfolder named after the model and scheme.
    (folder,) = {os.path.dirname(p) for p in glob.glob(os.path.join(args.out + ".tmp", "**", "config.json"),
                                                           recursive=True)}
    shutil.move(folder, args.out)
    shutil.rmtree(args.out + ".tmp", ignore_errors=True)
    print(json.dumps({"autoround_s": round(took, 1), "iters": args.iters, "samples": len(rows), "seqlen": seqlen,
                      "tokens": len(rows) * seqlen}), flush=True)


if __name__ == "__main__":
    main()
