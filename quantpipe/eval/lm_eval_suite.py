"""A suite's lm-evaluation-harness tasks (`lm_eval: {tasks, num_fewshot, limit}`): each
model scored by real lm-eval through the runtime, the per-item results kept, and each
candidate compared with the baseline on the identical requests: recovery (candidate /
baseline of the task's first metric) and flips (items whose correctness changed, in both
directions), each with a paired bootstrap 95% CI over items. Gate rules name them as
`lm_eval.TASK.recovery` and `lm_eval.TASK.flips_pct`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import quantpipe.evals
from quantpipe.eval.stats import mean_with_se, recovery_and_flips
from quantpipe.manifest import StageError

TASKS_DIR = Path(quantpipe.evals.__file__).resolve().parent / "lm_eval_tasks"


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None):
    """lm-eval's index of its own tasks, the shipped ones and `include_path`'s: built once per
    process (it reads about 15,000 task files, seconds each time), shared by every model scored."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR)] + ([include_path] if include_path else []))


def score_tasks(model, tokenizer, pretrained: str | None, section: dict) -> dict[str, dict]:
    """{task: {metric, filter, items: [{doc_id, value, request}]}} for one loaded model."""
    from lm_eval import simple_evaluate

    from quantpipe.eval.lm_eval_model import QuantpipeLM

    lm = QuantpipeLM.from_loaded(model, tokenizer, pretrained)
    try:
        res = simple_evaluate(model=lm, tasks=list(section["tasks"]), num_fewshot=section["num_fewshot"],
                              limit=section["limit"], log_samples=True, bootstrap_iters=0,
                              task_manager=task_manager(section.get("include_path")))
    except (KeyError, ValueError) as e:  # lm-eval's words for an unknown task or a bad argument
        raise StageError(f"suite lm_eval: {e}") from None
    out = {}
    for task in section["tasks"]:
        samples = res["samples"].get(task)
        if not samples:
            raise StageError(f"suite lm_eval.tasks: {task!r} produced no scored items (a group name? name its tasks)")
        metric = res["configs"][task]["metric_list"][0]["metric"]
        filt = samples[0]["filter"]
        items = sorted(({"doc_id": s["doc_id"], "value": float(s[metric]), "request": repr(s["arguments"])}
                        for s in samples if s["filter"] == filt), key=lambda r: r["doc_id"])
        out[task] = {"metric": metric, "filter": filt, "items": items}
    return out


def compare(base: dict, cand: dict, replicates: int, seed: int) -> dict[str, dict]:
    """Per task: both models' metric (mean, lm-eval style standard error), recovery and flips with CIs."""
    out = {}
    for task, b in base.items():
        c = cand[task]
        if [r["request"] for r in b["items"]] != [r["request"] for r in c["items"]]:
            raise StageError(f"lm_eval task {task}: baseline and candidate were not sent identical requests")
        bv, cv = [r["value"] for r in b["items"]], [r["value"] for r in c["items"]]
        out[task] = {"metric": b["metric"], "filter": b["filter"], "n": len(bv),
                     "baseline": mean_with_se(bv), "candidate": mean_with_se(cv),
                     **recovery_and_flips(bv, cv, replicates, seed)}
    return out
