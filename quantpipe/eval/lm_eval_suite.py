"""The eval's lm-evaluation-harness runs. A suite's `lm_eval: {tasks, num_fewshot, limit}`
tasks, and its multiple-choice section (the shipped BIG-bench tasks as lm-eval's
`quantpipe_bigbench_*`): each model scored by real lm-eval through the runtime, the
per-item results kept, and each candidate compared with the baseline on the identical
requests: recovery (candidate / baseline of the task's first metric) and flips (items
whose correctness changed, in both directions), each with a paired bootstrap 95% CI over
items. Gate rules name them as `lm_eval.TASK.recovery` and `lm_eval.TASK.flips_pct`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import quantpipe.evals
from quantpipe.eval.stats import mean_with_se, recovery_and_flips
from quantpipe.manifest import StageError

TASKS_DIR = Path(quantpipe.evals.__file__).resolve().parent / "lm_eval_tasks"


BIGBENCH = "quantpipe_bigbench_"  # the shipped tasks' prefix: the multiple-choice section's task names


@functools.lru_cache(maxsize=8)
def task_manager(include_path: str | None, defaults: bool = True):
    """lm-eval's index of the shipped tasks, `include_path`'s and (`defaults`) its own: built
    once per process and shared by every model scored. Its own are about 15,000 task files,
    seconds to index, so a run that names none of them leaves them out."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR)] + ([include_path] if include_path else []),
                       include_defaults=defaults)


def _run(model, tokenizer, pretrained: str | None, tasks: list[str], num_fewshot: int | None, limit: int | None,
         include_path: str | None, where: str) -> dict[str, dict]:
    """{task: {metrics, filter, items: [{doc_id, request, METRIC: value, ...}]}}: real lm-eval
    over the runtime (QuantpipeLM), per-item results kept, items in document order."""
    from lm_eval import simple_evaluate

    from quantpipe.eval.lm_eval_model import QuantpipeLM

    local = task_manager(include_path, defaults=False)
    tm = local if set(tasks) <= set(local.all_tasks) else task_manager(include_path)
    lm = QuantpipeLM.from_loaded(model, tokenizer, pretrained)
    try:
        res = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, log_samples=True,
                              bootstrap_iters=0, task_manager=tm)
    except (KeyError, ValueError) as e:  # lm-eval's words for an unknown task or a bad argument
        raise StageError(f"suite {where}: {e}") from None
    out = {}
    for task in tasks:
        samples = res["samples"].get(task)
        if not samples:
            raise StageError(f"suite {where}: {task!r} produced no scored items (a group name? name its tasks)")
        metrics = [m["metric"] for m in res["configs"][task]["metric_list"]]
        filt = samples[0]["filter"]
        items = sorted(({"doc_id": s["doc_id"], "request": repr(s["arguments"]), **{m: float(s[m]) for m in metrics}}
                        for s in samples if s["filter"] == filt), key=lambda r: r["doc_id"])
        out[task] = {"metrics": metrics, "filter": filt, "items": items}
    return out


def score_tasks(model, tokenizer, pretrained: str | None, section: dict) -> dict[str, dict]:
    """A suite's `lm_eval` section for one loaded model: {task: {metric, filter, items}},
    each item's `value` the task's first metric."""
    out = {}
    for task, r in _run(model, tokenizer, pretrained, list(section["tasks"]), section["num_fewshot"],
                        section["limit"], section.get("include_path"), "lm_eval.tasks").items():
        metric = r["metrics"][0]
        out[task] = {"metric": metric, "filter": r["filter"],
                     "items": [{"doc_id": i["doc_id"], "value": i[metric], "request": i["request"]}
                               for i in r["items"]]}
    return out


def score_mc(model, tokenizer, pretrained: str | None, tasks: list[str], limit: int | None) -> dict[str, dict]:
    """A suite's multiple-choice section for one loaded model, through lm-eval's
    `quantpipe_bigbench_TASK` tasks: {task: {acc: [...], acc_norm: [...], requests: [...]}}
    per item, zero-shot, in the task file's order."""
    res = _run(model, tokenizer, pretrained, [BIGBENCH + t for t in tasks], 0, limit, None, "mc.tasks")
    return {t: {m: [i[m] for i in r["items"]] for m in ("acc", "acc_norm", "request")}
            for t, r in zip(tasks, (res[BIGBENCH + t] for t in tasks))}


def check_identical(base: list[str], cand: list[str], where: str) -> None:
    if base != cand:
        raise StageError(f"{where}: baseline and candidate were not sent identical requests")


def compare(base: dict, cand: dict, replicates: int, seed: int) -> dict[str, dict]:
    """Per task: both models' metric (mean, lm-eval style standard error), recovery and flips with CIs."""
    out = {}
    for task, b in base.items():
        c = cand[task]
        check_identical([r["request"] for r in b["items"]], [r["request"] for r in c["items"]], f"lm_eval task {task}")
        bv, cv = [r["value"] for r in b["items"]], [r["value"] for r in c["items"]]
        out[task] = {"metric": b["metric"], "filter": b["filter"], "n": len(bv),
                     "baseline": mean_with_se(bv), "candidate": mean_with_se(cv),
                     **recovery_and_flips(bv, cv, replicates, seed)}
    return out
