"""Does an engine stepping in a worker thread (as `quantpipe serve` does) run slower than
one stepping in the main thread? Small chat-cpu subset (24 requests, lengths x0.5).

    .venv/bin/python benchmarks/bench_engine_thread.py main         # load + step in main
    .venv/bin/python benchmarks/bench_engine_thread.py load-main    # load in main, step in a thread
    .venv/bin/python benchmarks/bench_engine_thread.py load-thread  # load + step in a thread
    .venv/bin/python benchmarks/bench_engine_thread.py load-other   # load in thread A, step in thread B
"""

import sys
import threading
import time

from quantpipe.runtime import SamplingParams
from quantpipe.runtime.llm_engine import EngineArgs, LLMEngine
from quantpipe.runtime.workload import materialize, preset


def build() -> LLMEngine:
    return LLMEngine(EngineArgs(dtype="bfloat16", max_model_len=2048, kv_cache_memory="512MiB"))


def run(eng: LLMEngine) -> float:
    reqs = materialize(preset("chat-cpu", num_requests=24, length_scale=0.5), eng.tokenizer)
    for r in reqs:
        eng.add_request(r.prompt_ids, SamplingParams(temperature=0, max_tokens=r.output_tokens, ignore_eos=True))
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "main"
    result: dict[str, float] = {}
    if mode == "main":
        result["s"] = run(build())
    elif mode == "load-main":
        eng = build()
        worker = threading.Thread(target=lambda: result.setdefault("s", run(eng)))
        worker.start()
        worker.join()
    elif mode == "load-thread":
        worker = threading.Thread(target=lambda: result.setdefault("s", run(build())))
        worker.start()
        worker.join()
    elif mode == "load-other":
        loaded: dict[str, LLMEngine] = {}
        loader = threading.Thread(target=lambda: loaded.setdefault("engine", build()))
        loader.start()
        loader.join()
        worker = threading.Thread(target=lambda: result.setdefault("s", run(loaded["engine"])))
        worker.start()
        worker.join()
    else:
        raise SystemExit(f"mode must be main, load-main, load-thread or load-other, got {mode!r}")
    print(f"{mode}: {result['s']:.2f} s")


if __name__ == "__main__":
    main()
