"""Offline decode speed with an INT8 KV cache against the model-dtype cache, side by side.

    .venv/bin/python benchmarks/bench_kv_speed.py [--dtype bfloat16] [--repeats 3]

The chat-cpu workload through `LLM.generate`, once per repeat for each cache
(`kv_cache_dtype` auto and int8, alternating); prints output tokens/s per run and the
median of the per-repeat ratios int8 / auto.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from quantpipe.runtime import LLM, SamplingParams
from quantpipe.runtime.workload import materialize, preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llms = {kind: LLM(dtype=args.dtype, device="cpu", kv_cache_dtype=kind) for kind in ("auto", "int8")}
    reqs = materialize(preset("chat-cpu"), llms["auto"].get_tokenizer())
    prompts = [r.prompt_ids for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_tokens, ignore_eos=True) for r in reqs]
    rates: dict[str, list[float]] = {kind: [] for kind in llms}
    for _ in range(args.repeats):
        for kind, llm in llms.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[kind].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    ratio = statistics.median(a / b for a, b in zip(rates["int8"], rates["auto"]))
    print(json.dumps({"dtype": args.dtype, "output_tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                      "int8_over_auto_median": round(ratio, 3)}))


if __name__ == "__main__":
    main()
