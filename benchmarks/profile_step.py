"""Where a batched decode step (and a mixed prefill+decode step) of the engine spends its time.

    .venv/bin/python benchmarks/profile_step.py [--dtype bfloat16] [--running 64] [--steps 12]
    .venv/bin/python benchmarks/profile_step.py --prefill [--dtype bfloat16]

The chat-cpu prompts (their real lengths) are admitted and prefilled, then the engine is
stepped with every request decoding: wall time per step by phase (schedule, host-side
batch building + model, sampling, bookkeeping), then torch.profiler's table per op over
the same kind of steps, and cProfile's per-Python-frame totals.

--prefill: steps that only prefill (what a burst of new requests waits for before its
first tokens): 16 distinct 500-token prompts cut from Python's documentation, so no prefix
cache hits, each asking one token; prefill tok/s, then the per-op table of a second batch.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from quantpipe.runtime import LLM, SamplingParams
from quantpipe.runtime.model.sampler import sample
from quantpipe.runtime.workload import materialize, preset


def fill(llm: LLM, running: int, decode_only: bool):
    eng = llm.engine
    reqs = materialize(preset("chat-cpu"), llm.get_tokenizer())[:running]
    for r in reqs:
        eng.add_request(r.prompt_ids, SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
    if decode_only:
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) \
                or eng.scheduler.waiting:
            eng.step()
    return eng


def timed_steps(eng, n: int) -> dict[str, float]:
    """Median ms per phase over n steps, phases timed by wrapping the engine's calls."""
    phases = {"schedule": [], "execute": [], "sample": [], "step": []}
    sched_fn, exec_fn = eng.scheduler.schedule, eng.runner.execute

    def clock(name, fn):
        def inner(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            phases[name].append(time.perf_counter() - t)
            return out
        return inner

    eng.scheduler.schedule = clock("schedule", sched_fn)
    eng.runner.execute = clock("execute", exec_fn)
    import quantpipe.runtime.llm_engine as le

    real_sample = le.sample
    le.sample = clock("sample", sample)
    try:
        for _ in range(n):
            t = time.perf_counter()
            eng.step()
            phases["step"].append(time.perf_counter() - t)
    finally:
        eng.scheduler.schedule, eng.runner.execute, le.sample = sched_fn, exec_fn, real_sample
    out = {k: statistics.median(v) * 1e3 for k, v in phases.items() if v}
    out["other"] = out["step"] - out["schedule"] - out["execute"] - out.get("sample", 0)
    return out


def prefill(llm: LLM, ops: int) -> None:
    from pydoc_data.topics import topics

    ids = llm.get_tokenizer().encode("\n\n".join(topics[k] for k in sorted(topics)))
    batches = [[ids[(b * 16 + i) * 600:(b * 16 + i) * 600 + 500] for i in range(16)] for b in range(5)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(batches[0][:2], one)  # warm
    rates = []
    for batch in batches[1:4]:
        t = time.perf_counter()
        llm.generate(batch, one)
        rates.append(16 * 500 / (time.perf_counter() - t))
    print(f"prefill, 16 x 500 tokens: {statistics.median(rates):.0f} tok/s (median of 3: "
          + ", ".join(f"{r:.0f}" for r in rates) + ")")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(batches[4], one)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ops))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ops", type=int, default=22, help="rows of the per-op table")
    ap.add_argument("--prefill", action="store_true", help="profile prefill-only steps instead")
    ap.add_argument("--disable-cpu-kernels", default="", metavar="NAMES",
                    help="the runtime's CPU kernels to turn off (runtime/model/cpu_kernels.py)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(dtype=args.dtype, device="cpu", max_num_seqs=args.running, disable_cpu_kernels=args.disable_cpu_kernels)
    if args.prefill:
        return prefill(llm, args.ops)
    eng = fill(llm, args.running, decode_only=True)
    timed_steps(eng, 2)  # warm
    t = timed_steps(eng, args.steps)
    print(f"decode step, {len(eng.scheduler.running)} running: " +
          ", ".join(f"{k} {v:.1f} ms" for k, v in t.items()) +
          f" -> {len(eng.scheduler.running) / t['step'] * 1e3:.0f} tok/s")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(4):
        eng.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(28)
    print(s.getvalue())
    # A mixed step: the same engine with new prompts arriving while the others decode.
    for r in materialize(preset("chat-cpu", seed=1), llm.get_tokenizer())[:8]:
        eng.add_request(r.prompt_ids, SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
    t = timed_steps(eng, 4)
    print("mixed steps (prefill chunks + decodes): " + ", ".join(f"{k} {v:.1f} ms" for k, v in t.items()))


if __name__ == "__main__":
    main()
