"""KV cache formats on the default model: tokens per KV byte and the quality they cost.

    .venv/bin/python benchmarks/bench_kv_cache.py --heldout calib_sets/sample-set --calib calib_sets/sample-set \
        [--max-texts 64] [--max-tokens 256] [--calib-samples 32] [--formats int8,fp8,int8-channel,int8-head]

The weights stay as they are (float32), so every difference is the cache's. Each format
scores the held-out texts with the teacher-forced scorer against the model-dtype cache:
dynamic INT8 and FP8 (a scale per token and KV head, computed as tokens are written),
and static INT8 with scales calibrated on --calib, one per KV head and channel (what
`quantize --kv-cache-strategy channel` stores) or one per KV head (coarser; shown to
justify per channel). Tokens per byte come from the engine's block count for one budget.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# --formats name: (kv_cache_dtype, what is stored)
FORMATS = {"int8": ("int8", "dynamic (token, head)"), "fp8": ("fp8", "dynamic (token, head)"),
           "int8-channel": ("int8", "static (head, channel)"), "int8-head": ("int8", "static (head)")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", required=True, help="a quantpipe calibrate folder: its heldout.jsonl is scored")
    ap.add_argument("--calib", required=True, help="a quantpipe calibrate folder: static scales come from it")
    ap.add_argument("--max-texts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"some of: {', '.join(FORMATS)}")
    args = ap.parse_args()
    wanted = args.formats.split(",")
    unknown = sorted(set(wanted) - set(FORMATS))
    if unknown:
        ap.error(f"--formats: unknown {unknown[0]!r}; known: {', '.join(FORMATS)}")

    from quantpipe.eval.scorer import score_many
    from quantpipe.eval.stats import quality_with_ci
    from quantpipe.formats.calib_set import CalibSet
    from quantpipe.quantize.kv import static_kv_scales
    from quantpipe.quantize.stage import calibration_texts
    from quantpipe.runtime.llm_engine import LLMEngine
    from quantpipe.runtime.model.loader import load_model

    rows = CalibSet.open(args.heldout, "--heldout").rows("heldout")[: args.max_texts]
    base, _, tok = load_model(None, torch.float32)
    texts, _ = calibration_texts(args.calib)
    calib = [tok.encode(t)[:512] for t in texts[: args.calib_samples]]
    per_channel = static_kv_scales(base, calib, "int8")
    per_head = [tuple(s.amax(-1, keepdim=True).expand_as(s).contiguous() for s in pair) for pair in per_channel]

    cand, _, _ = load_model(None, torch.float32)
    static = {"int8": None, "fp8": None, "int8-channel": per_channel, "int8-head": per_head}
    formats = {label: (FORMATS[label], static[label]) for label in wanted}
    print(f"{len(rows)} held-out texts, <= {args.max_tokens} tokens each; static scales from {len(calib)} sequences")
    print("| KV cache | tokens per byte vs bf16 | ppl delta % [95% CI] | mean KL [95% CI] | top-1 agreement |")
    print("| --- | --- | --- | --- | --- |")
    budget = 64 << 20
    bf16_blocks = LLMEngine(dtype="bfloat16", device="cpu", kv_cache_memory=budget).pool.num_blocks
    for (kind, desc), scales in formats.values():
        cand.kv_cache_dtype = kind
        for layer, pair in zip(cand.layers, scales or [None] * len(cand.layers)):
            layer.self_attn.kv_scales = pair
        scores = score_many(base, [cand], tok, [r["text"] for r in rows], max_tokens=args.max_tokens)[0]
        q = quality_with_ci(scores, list(range(len(scores.texts))), replicates=1000, seed=0)
        eng = LLMEngine(dtype="bfloat16", device="cpu", kv_cache_memory=budget, kv_cache_dtype=kind)
        if scales is not None:  # the engine's own count for a static cache: no per-token scales
            from quantpipe.runtime.model.kv_cache import bytes_per_token

            c = eng.model_config
            blocks = budget // (16 * bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.bfloat16,
                                                     kind, static=True))
        else:
            blocks = eng.pool.num_blocks
        ppl, kl, top1 = q["ppl_delta_pct"], q["kl_mean"], q["top1_agreement"]
        print(f"| {kind} {desc} | {blocks / bf16_blocks:.2f}x | {ppl['point']:+.2f} [{ppl['ci_lower']:+.2f}, "
              f"{ppl['ci_upper']:+.2f}] | {kl['point']:.5f} [{kl['ci_lower']:.5f}, {kl['ci_upper']:.5f}] | "
              f"{top1['point']:.2%} |")


if __name__ == "__main__":
    main()
