"""The default suite's multiple-choice items (3 tasks, at most 100 each: 270) scored two
ways on the default model in float32, side by side, alternating: the eval's own loop (`quantpipe.eval.mc`) and
real lm-eval through the `quantpipe` model (`quantpipe.eval.lm_eval_suite`, the suite's
`lm_eval` section). Prints each round's seconds and whether every item agrees.

    .venv/bin/python benchmarks/bench_lm_eval.py
"""

from __future__ import annotations

import time

import torch

from quantpipe.eval import lm_eval_suite, mc
from quantpipe.eval.suite import EvalSuite
from quantpipe.runtime.model.loader import load_model


def main() -> None:
    suite = EvalSuite.load()
    tasks, limit = suite.mc["tasks"], suite.mc["limit"]
    section = {"tasks": [f"quantpipe_bigbench_{t}" for t in tasks], "num_fewshot": 0, "limit": limit,
               "include_path": None}
    model, _, tok = load_model(None, torch.float32)
    t = time.perf_counter()
    lm_eval_suite.task_manager(None)
    print(f"lm-eval task index (once per process): {time.perf_counter() - t:.1f} s")
    for rnd in range(2):
        t = time.perf_counter()
        ours = mc.evaluate({"m": model}, tok, tasks, limit)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        theirs = lm_eval_suite.score_tasks(model, tok, None, section)
        t_theirs = time.perf_counter() - t
        same = all([r["value"] for r in theirs[f"quantpipe_bigbench_{task}"]["items"]] == ours[task]["m"]["acc"]
                   for task in tasks)
        print(f"round {rnd + 1}: eval's own loop {t_ours:.1f} s, through lm-eval {t_theirs:.1f} s "
              f"({len(tasks)} tasks x {limit} items); every item agrees: {same}")


if __name__ == "__main__":
    main()
