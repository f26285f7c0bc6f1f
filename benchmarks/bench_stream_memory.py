"""Peak resident memory of layer-streamed quantization against model size.

Writes random Llama-architecture HF folders (bf16, 262,144-token vocabulary, hidden 1024
unless `--hidden` says otherwise) of several sizes, quantizes each to W4A16 g128 with RTN and
GPTQ under `--max-memory` (in a child process whose data segment, RLIMIT_DATA, is capped at
the same size), and prints the peak resident memory each run reports, with its wall time. The whole-model path runs on the
smallest model for comparison (no cap).

    .venv/bin/python benchmarks/bench_stream_memory.py --layers 16,64,130 --limit 1.5GB

`--layers 130 --methods gptq` is the 2.5 GB GPTQ run on many narrow layers (long: every layer
costs GPTQ's column loop over 2,048 calibration tokens); `--layers 8 --hidden 2048` is the
2.5 GB model of tests/quantize/test_stream_memory.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe.quantize.stream import parse_size  # noqa: E402
from tests.quantize.test_stream_memory import quantize_argv, write_big_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="16,64,130", help="decoder layers of each model")
    ap.add_argument("--limit", default="1.5GB", help="--max-memory, and the child's data-segment cap")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden (and MLP) size of every model")
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    limit = parse_size(args.limit, "--limit")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-stream-"))
    rows = []
    for k, layers in enumerate(int(x) for x in args.layers.split(",")):
        src = work / f"llama-{layers}"
        if src.exists():
            shutil.rmtree(src)
        size = write_big_llama(src, layers, args.hidden)
        runs = [(m, "streamed", limit) for m in args.methods.split(",")]
        if k == 0:
            runs += [(m, "whole", None) for m in args.methods.split(",")]
        for method, budget, cap in runs:
            out = work / f"out-{layers}-{method}-{budget}"
            t = time.perf_counter()
            got = subprocess.run(quantize_argv(src, out, method, None if budget == "whole" else limit, cap),
                                 capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            wall = time.perf_counter() - t
            if got.returncode != 0:
                print(got.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"{method} on {layers} layers failed")
            manifest = json.loads((out / "quantpipe.json").read_text())
            row = {"layers": layers, "weights_gb": round(size / 1e9, 2), "method": method,
                   "path": "whole" if cap is None else "streamed", "limit_mib": None if cap is None else limit // 2 ** 20,
                   "peak_rss_mib": manifest["peak_rss_mib"], "wall_s": round(wall, 1),
                   "plan_mib": (manifest["memory"] or {}).get("plan", {}).get("estimate_mib")}
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(out)
        shutil.rmtree(src)
    print("| layers | bf16 weights | method | path | peak RSS | limit | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['layers']} | {r['weights_gb']} GB | {r['method']} | {r['path']} | {r['peak_rss_mib']} MiB | "
              f"{r['limit_mib'] or 'none'} | {r['wall_s']} s |")


if __name__ == "__main__":
    main()
