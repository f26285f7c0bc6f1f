"""quantpipe's GPTQ against the anchors' best W4A16 recipes: same token ids, same scorer.

    bash scripts/setup-anchors   # .anchors/: llmcompressor and auto-round, each in its own virtualenv
    .venv/bin/python benchmarks/bench_vs_llmcompressor.py --calib calib_sets/sample-set \
        [--heldout calib_sets/sample-set] [--calib-samples 128 --calib-seq-len 512] \
        [--lc-observers default,imatrix_mse] [--same-length 256 --autoround] \
        [--ours gptq,gptq-minmax,rtn,autoround,gptq-r1r4,autoround-r1r4]

llmcompressor and auto-round pin transformers and compressed-tensors versions other than
quantpipe's, so each runs in a virtualenv of its own. The default model is written as a
float32 HF folder; the calibration sequences quantpipe's GPTQ would take from `--calib`
are written out as token ids and given to every run (with `--same-length L`, only those of
at least L tokens, each cut to L: auto-round skips shorter ones). All quantize W4A16
group 64 symmetric, lm_head kept. llm-compressor runs GPTQModifier (dampening 0.01) once
per weight observer: its default min-max, and `imatrix_mse` (an importance-weighted range
search, its README's best W4A16 result). `--autoround` adds auto-round's own quantizer with
its defaults. quantpipe runs (`--ours`) GPTQ with its defaults (act-order with static
groups, the range search), GPTQ on the min-max grid and RTN, and on request its own
`--method autoround`, and GPTQ or AutoRound after the R1 + R4 rotations. Each artifact is loaded by quantpipe's
loader in float32 and scored against the source model on the held-out texts by the
teacher-forced scorer; the table's ratio is each perplexity increase over the best
anchor's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


AR_NAME = "auto-round AutoRound (its defaults)"
LC_NAMES = {"default": "llm-compressor GPTQModifier", "imatrix_mse": "llm-compressor GPTQModifier + imatrix_mse"}


# quantpipe's runs: the table's name and the QuantConfig fields beside the shared ones.
OURS = {"gptq": ("quantpipe GPTQ (its defaults: act-order, range search)", dict(method="gptq")),
        "gptq-minmax": ("quantpipe GPTQ, min-max grid", dict(method="gptq", clip="minmax")),
        "rtn": ("quantpipe RTN", dict(method="rtn")),
        "autoround": ("quantpipe --method autoround (its defaults: 200 steps, batches of 8)",
                      dict(method="autoround")),
        "gptq-r1r4": ("quantpipe GPTQ, its defaults + --rotate R1,R4", dict(method="gptq", rotations=("R1", "R4"))),
        "autoround-r1r4": ("quantpipe --method autoround --rotate R1,R4",
                           dict(method="autoround", rotations=("R1", "R4")))}


def _names(known: dict, allow_empty: bool = False):
    def parse(value: str) -> list[str]:
        names = [v for v in value.split(",") if v]
        unknown = [v for v in names if v not in known]
        if (not names and not allow_empty) or unknown:
            raise argparse.ArgumentTypeError(f"{value!r}: a comma-separated list of {', '.join(known)}")
        return names
    return parse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lc-python", default=os.path.join(ROOT, ".anchors", "llmcompressor", "bin", "python"),
                    help="python of a virtualenv with llmcompressor (scripts/setup-anchors makes .anchors/llmcompressor)")
    ap.add_argument("--lc-observers", type=_names(LC_NAMES, allow_empty=True), default=["default", "imatrix_mse"],
                    help="llm-compressor GPTQ runs, one per weight observer: default (its min-max), imatrix_mse; "
                         "empty: none")
    ap.add_argument("--ours", type=_names(OURS), default=["gptq", "gptq-minmax", "rtn"],
                    help=f"quantpipe's runs, of {', '.join(OURS)}")
    ap.add_argument("--ar-python", default=os.path.join(ROOT, ".anchors", "auto-round", "bin", "python"),
                    help="python of a virtualenv with auto-round (scripts/setup-anchors makes .anchors/auto-round)")
    ap.add_argument("--autoround", action="store_true",
                    help="also auto-round's own quantizer (its defaults: 200 iterations per layer); needs --same-length")
    ap.add_argument("--same-length", type=int, default=None, metavar="L",
                    help="only the calibration sequences of at least L tokens, each cut to L, for every run "
                         "(auto-round skips shorter ones)")
    ap.add_argument("--calib", required=True, help="a quantpipe calibrate set (its calib.jsonl)")
    ap.add_argument("--heldout", default=None, help="a quantpipe calibrate set whose heldout.jsonl is scored")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--max-texts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # quantize's progress
    if args.autoround and not args.same_length:
        ap.error("--autoround needs --same-length (auto-round calibrates on sequences of one length)")
    if not args.lc_observers and not args.autoround:
        ap.error("no anchor to compare with: name --lc-observers or --autoround")

    from benchmarks.bench_quantize import heldout_texts
    from quantpipe.eval.scorer import score_many
    from quantpipe.quantize import QuantConfig, quantize
    from quantpipe.quantize.stage import _token_samples, calibration_texts
    from quantpipe.runtime.model.loader import load_model

    heldout = args.heldout or args.calib
    texts, strata = heldout_texts(heldout, args.max_texts)
    base, _, tok = load_model(None, torch.float32)
    cfg = dict(scheme="W4A16", group_size=args.group_size, calib_samples=args.calib_samples,
               calib_seq_len=args.calib_seq_len, dampening=0.01)
    samples = _token_samples(calibration_texts(args.calib)[0], tok, QuantConfig(**cfg))
    if args.same_length:
        samples = [s[:args.same_length] for s in samples if len(s) >= args.same_length]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, ids = os.path.join(tmp, "hf"), os.path.join(tmp, "samples.json")
        subprocess.run([sys.executable, "-m", "quantpipe", "export-hf", hf, "--dtype", "float32"], check=True)
        with open(ids, "w") as f:
            json.dump(samples, f)
        arts = {}
        for observer in args.lc_observers:
            out = os.path.join(tmp, f"llmcompressor-{observer}")
            lc = subprocess.run([args.lc_python, os.path.join(ROOT, "benchmarks", "llmcompressor_gptq.py"), hf, ids,
                                 out, "--group-size", str(args.group_size), "--observer", observer],
                                check=True, stdout=subprocess.PIPE, text=True)
            lc_run = json.loads(lc.stdout.strip().splitlines()[-1])  # its oneshot's own time, imports left out
            arts[LC_NAMES[observer]] = (out, lc_run["llmcompressor_gptq_s"])
            print(json.dumps(lc_run), flush=True)
        if args.autoround:
            out = os.path.join(tmp, "auto-round")
            ar = subprocess.run([args.ar_python, os.path.join(ROOT, "benchmarks", "autoround_quantize.py"), hf, ids,
                                 out, "--group-size", str(args.group_size)], check=True, stdout=subprocess.PIPE, text=True)
            ar_run = json.loads(ar.stdout.strip().splitlines()[-1])
            arts[AR_NAME] = (out, ar_run["autoround_s"])
            print(json.dumps(ar_run), flush=True)
        for key in args.ours:
            name, extra = OURS[key]
            out = os.path.join(tmp, f"ours-{key}")
            t = time.perf_counter()
            quantize(None, QuantConfig(**cfg, **extra), None, out,
                     calib_token_ids=samples if extra["method"] != "rtn" else None)
            arts[name] = (out, time.perf_counter() - t)
            print(json.dumps({"quantpipe": key, "quantize_s": round(arts[name][1], 1)}), flush=True)
        cands = [load_model(path, torch.float32)[0] for path, _ in arts.values()]
        for (name, (_, took)), q in zip(arts.items(), score_many(base, cands, tok, texts, strata, args.max_tokens)):
            s = q.summary()
            results.append({"artifact": name, "ppl_delta_pct": round(s["ppl_delta_pct"], 2),
                            "kl_mean": round(s["kl_mean"], 4), "top1_agreement": round(s["top1_agreement"], 4),
                            "quantize_s": round(took, 1), "tokens": s["tokens"]})
            print(json.dumps(results[-1]), flush=True)
    anchors = [r for r in results if r["artifact"] in (*LC_NAMES.values(), AR_NAME)]
    best = min(anchors, key=lambda r: r["ppl_delta_pct"])
    print(f"\n{len(samples)} calibration sequences ({sum(map(len, samples))} tokens) from {args.calib}; "
          f"{len(texts)} held-out texts of {heldout}, {args.max_tokens} tokens at most; "
          f"best anchor: {best['artifact']}")
    print("| artifact | perplexity delta | vs the best anchor's | mean KL | top-1 agreement | time to quantize |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['artifact']} | {r['ppl_delta_pct']:+.1f}% | {r['ppl_delta_pct'] / best['ppl_delta_pct']:.2f}x | "
              f"{r['kl_mean']:.3f} | {r['top1_agreement']:.1%} | {r['quantize_s']:.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
