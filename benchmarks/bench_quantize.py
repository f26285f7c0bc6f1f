"""Quality and size of quantized artifacts of a model (the default one unless --model), side by
side in one run.

    .venv/bin/python benchmarks/bench_quantize.py --heldout calib_sets/sample-set --calib calib_sets/sample-set \
        [--configs w8a16,w4g64-rtn,w4g64-mse,w4g64-gptq] [--max-texts 64] [--max-tokens 256] [--model gemma3-270m] \
        [--artifacts NAME=FOLDER,...]

Each config is quantized into a temporary artifact (timed), loaded in float32 (the
dequantized path: the same function every kernel computes), and scored against the
source model on the held-out texts with the teacher-forced scorer (perplexity, KL,
top-1 agreement; overall and per stratum). `--artifacts` scores artifacts already written
(by another commit, say) in the same run, after the configs, with the size of their weight
files. The default model is Q4_1 dequantized, so damage is measured on top of Q4_1; W4
group 64 symmetric is the headline grid (group 32 asymmetric lines up with Q4_1 and hides
damage; 128 does not divide 576).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = {
    "w8a16": dict(scheme="W8A16"),
    "w8a16-mse": dict(scheme="W8A16", clip="mse"),
    "w8a16-gptq": dict(scheme="W8A16", method="gptq", clip="minmax"),
    "w8a16-gptq-mse": dict(scheme="W8A16", method="gptq", clip="mse"),
    "w8a16-asym": dict(scheme="W8A16", symmetric=False),
    "w8a16-asym-gptq-mse": dict(scheme="W8A16", symmetric=False, method="gptq", clip="mse"),
    "w4g64-rtn": dict(scheme="W4A16", group_size=64),
    "w4g64-mse": dict(scheme="W4A16", group_size=64, clip="mse"),
    "w4g64-gptq": dict(scheme="W4A16", group_size=64, method="gptq", clip="minmax", rotations=()),
    "w4g64-gptq-mse": dict(scheme="W4A16", group_size=64, method="gptq", clip="mse", rotations=()),
    "w4g64-gptq-actorder": dict(scheme="W4A16", group_size=64, method="gptq", act_order=True, clip="minmax", rotations=()),
    "w4g32-asym-rtn": dict(scheme="W4A16", group_size=32, symmetric=False),
    "w8a8": dict(scheme="W8A8"),  # the default: R1 + R4 as far as the model takes them, no SmoothQuant
    "w8a8-sq": dict(scheme="W8A8", smoothquant_alpha=0.5, rotations=()),
    "w8a8-gptq-sq": dict(scheme="W8A8", method="gptq", clip="minmax", smoothquant_alpha=0.5, rotations=()),
    "w8a8-gptq-sq-mse": dict(scheme="W8A8", method="gptq", smoothquant_alpha=0.5, rotations=()),
    "w8a8-rtn": dict(scheme="W8A8", rotations=()),
    "w8a8-r1": dict(scheme="W8A8", rotations=("R1",)),
    "w8a8-r4": dict(scheme="W8A8", rotations=("R4",)),
    "w8a8-r4-h512": dict(scheme="W8A8", rotations=("R4",), hadamard_block_size=512),
    "w8a8-r1r4": dict(scheme="W8A8", rotations=("R1", "R4")),
    "w8a8-r1r4-h512": dict(scheme="W8A8", rotations=("R1", "R4"), hadamard_block_size=512),
    "w8a8-r1r4-h32": dict(scheme="W8A8", rotations=("R1", "R4"), hadamard_block_size=32),
    "w8a8-sq-r1r4": dict(scheme="W8A8", smoothquant_alpha=0.5, rotations=("R1", "R4")),
    "w8a8-gptq-r1r4": dict(scheme="W8A8", method="gptq", rotations=("R1", "R4")),
    "w4g64-gptq-mse-r4": dict(scheme="W4A16", group_size=64, method="gptq", rotations=("R4",)),
    "w4g64-gptq-mse-r1r4": dict(scheme="W4A16", group_size=64, method="gptq", rotations=("R1", "R4")),
    "w4g64-rtn-r1r4": dict(scheme="W4A16", group_size=64, rotations=("R1", "R4")),
    "w8a16-asym-gptq-mse-r1r4": dict(scheme="W8A16", symmetric=False, method="gptq", rotations=("R1", "R4")),
}


def docs_sets(folder: str) -> tuple[str, str]:
    """The documentation split of BENCHMARKS.md: calibration from the even-numbered pydoc
    topics, held-out texts from the odd-numbered ones (1,500-character chunks)."""
    from pydoc_data.topics import topics

    from quantpipe.calibrate import CalibConfig, calibrate

    keys = sorted(topics)
    os.makedirs(folder, exist_ok=True)
    for name, ks in (("calib", keys[::2]), ("heldout", keys[1::2])):
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            for k in ks:
                for i in range(0, len(topics[k]), 1500):
                    chunk = topics[k][i:i + 1500].strip()
                    if len(chunk) > 400:
                        f.write(json.dumps({"text": chunk, "topic": k}) + "\n")
    common = dict(text_field="text", strata=["length"], length_edges=[128, 256, 512], min_per_stratum=4,
                  overwrite=True)
    calibrate(CalibConfig(logs=[os.path.join(folder, "calib.jsonl")], size=128, heldout_size=0,
                          out=os.path.join(folder, "calib-set"), **common))
    calibrate(CalibConfig(logs=[os.path.join(folder, "heldout.jsonl")], size=64, heldout_size=64,
                          out=os.path.join(folder, "heldout-set"), **common))
    return os.path.join(folder, "heldout-set"), os.path.join(folder, "calib-set")


def heldout_texts(folder: str, max_texts: int) -> tuple[list[str], list[str]]:
    """Texts and strata of up to `max_texts` rows of a calibrate set's heldout.jsonl, taken
    evenly through the file so they spread over its strata."""
    from quantpipe.formats.calib_set import CalibSet

    rows = CalibSet.open(folder, "--heldout").rows("heldout")
    rows = rows[:: max(1, len(rows) // max_texts)][:max_texts]
    return [r["text"] for r in rows], [r["stratum"] for r in rows]


def figures(s: dict) -> dict:
    """A scorer summary's figures as the tables quote them."""
    return {"ppl_baseline": round(s["ppl_baseline"], 3), "ppl_candidate": round(s["ppl_candidate"], 3),
            "ppl_delta_pct": round(s["ppl_delta_pct"], 2), "kl_mean": round(s["kl_mean"], 5),
            "kl_p99": round(s["kl_p99"], 4), "top1_agreement": round(s["top1_agreement"], 4), "tokens": s["tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the source model (a name such as gemma3-270m, a GGUF or HF "
                    "folder) [default: the default model]")
    ap.add_argument("--heldout", default=None, help="a quantpipe calibrate set: its heldout.jsonl is scored")
    ap.add_argument("--docs-sets", default=None, metavar="DIR",
                    help="build the documentation split of BENCHMARKS.md in DIR and use it for --heldout/--calib")
    ap.add_argument("--calib", default=None, help="calibration set for GPTQ")
    ap.add_argument("--configs", default="w8a16,w4g64-rtn,w4g64-mse,w4g64-gptq", help="'' for none")
    ap.add_argument("--artifacts", default="", metavar="NAME=FOLDER,...", help="artifacts to score as they are")
    ap.add_argument("--max-texts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    args = ap.parse_args()
    if args.docs_sets:
        args.heldout, args.calib = docs_sets(args.docs_sets)
    if not args.heldout:
        ap.error("give --heldout (or --docs-sets DIR)")

    from quantpipe.eval.scorer import score
    from quantpipe.quantize import QuantConfig, quantize
    from quantpipe.runtime.model.loader import load_model

    texts, strata = heldout_texts(args.heldout, args.max_texts)
    base, _, tok = load_model(args.model, torch.float32)
    print(json.dumps({"model": args.model, "texts": len(texts), "max_tokens": args.max_tokens,
                      "heldout": args.heldout}), flush=True)
    given = dict(a.split("=", 1) for a in args.artifacts.split(",") if a)
    with tempfile.TemporaryDirectory() as tmp:
        for name in (c for c in args.configs.split(",") if c):
            opts = dict(CONFIGS[name], calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len)
            cfg = QuantConfig(**opts)
            out = os.path.join(tmp, name)
            t = time.perf_counter()
            art = quantize(args.model, cfg, args.calib if cfg.calibration_need() else None, out)
            quant_s = time.perf_counter() - t
            cand, _, _ = load_model(out, torch.float32)
            t = time.perf_counter()
            q = score(base, cand, tok, texts, strata, args.max_tokens)
            s = q.summary()
            per = {k: round(v["ppl_delta_pct"], 2) for k, v in q.by_stratum().items()}
            print(json.dumps({"config": name, "weights": art.manifest["weights"], "method": cfg.method, **figures(s),
                              "bytes_ratio": art.manifest["bytes"]["ratio"], "quantize_s": round(quant_s, 1),
                              "score_s": round(time.perf_counter() - t, 1), "ppl_delta_pct_by_stratum": per}),
                  flush=True)
            del cand
    for name, folder in given.items():
        cand, _, _ = load_model(folder, torch.float32)
        s = score(base, cand, tok, texts, strata, args.max_tokens).summary()
        size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        print(json.dumps({"artifact": name, **figures(s), "weight_file_bytes": size}), flush=True)
        del cand
    return 0


if __name__ == "__main__":
    sys.exit(main())
