"""Time to quantize the default model with GPTQ on N sequences of exactly L tokens.

    .venv/bin/python benchmarks/bench_gptq_time.py [--samples 512] [--seq-len 512] [--group-size 64] [--clip minmax]

The sequences are cut back to back from Python's own documentation (pydoc topics, in
sorted order), so every one has the full length, which a calibration set of real
requests does not guarantee. Prints the wall time and the manifest's per-phase times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--clip", choices=("minmax", "mse"), default=None, help="[default: GPTQ's, mse]")
    args = ap.parse_args()

    from pydoc_data.topics import topics

    from quantpipe.quantize import QuantConfig, quantize
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    stream = tok.encode("\n\n".join(topics[k] for k in sorted(topics)))
    need = args.samples * args.seq_len
    if len(stream) < need:
        stream = stream * (need // len(stream) + 1)  # pydoc holds ~1.1M tokens: only for very large asks
    samples = [stream[i * args.seq_len:(i + 1) * args.seq_len] for i in range(args.samples)]
    cfg = QuantConfig(scheme="W4A16", group_size=args.group_size, method="gptq", calib_samples=args.samples,
                      calib_seq_len=args.seq_len, clip=args.clip)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        art = quantize(None, cfg, None, os.path.join(tmp, "gptq"), calib_token_ids=samples)
        took = time.perf_counter() - t
    print(json.dumps({"samples": args.samples, "seq_len": args.seq_len, "tokens": need, "clip": cfg.clip,
                      "wall_s": round(took, 1),
                      "manifest_time_s": art.manifest.get("time_s"), "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
