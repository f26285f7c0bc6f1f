"""Multiple-choice accuracy by log-likelihood of each choice (lm-eval's `acc`/`acc_norm`).

Tasks are BIG-bench `task.json` files (see evals/mc/README.md). The prompt is built the
way BIG-bench does (task prefix, input prefix, input, output prefix) and each choice is
the continuation " " + choice; both models see the same token ids, scored in float32 one
sequence per forward call (batch-invariant, like the perplexity scorer).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import quantpipe.evals
from quantpipe.eval.stats import mean_with_se
from quantpipe.runtime.model.forward import continuation_logits

TASK_DIR = Path(quantpipe.evals.__file__).resolve().parent / "mc" / "bigbench"


@dataclass
class Item:
    context: str
    choices: list[str]
    correct: set[int]


def load_task(name: str, limit: int | None = None) -> list[Item]:
    path = TASK_DIR / f"{name}.json.gz"
    if not path.exists():
        known = sorted(p.name.removesuffix(".json.gz") for p in TASK_DIR.glob("*.json.gz"))
        raise ValueError(f"mc task {name!r} is not shipped; known: {', '.join(known)}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        task = json.load(f)
    prefix = task.get("task_prefix", "")
    q = task.get("example_input_prefix", "\nQ: ")
    a = task.get("example_output_prefix", "\nA: ").rstrip(" ")
    items = []
    for ex in task["examples"][:limit]:
        choices = list(ex["target_scores"])
        correct = {i for i, c in enumerate(choices) if ex["target_scores"][c] == max(ex["target_scores"].values())}
        items.append(Item((prefix + q + ex["input"] + a).lstrip("\n"), choices, correct))
    return items


@torch.inference_mode()
def choice_loglikelihoods(model, tokenizer, item: Item) -> list[float]:
    """Summed log-probability of each choice's tokens after the context, the context computed once."""
    ctx = tokenizer.encode(item.context)
    conts = [tokenizer.encode(" " + c) for c in item.choices]
    out = []
    for lg, cont in zip(continuation_logits(model, ctx, conts), conts):
        logp = F.log_softmax(lg.double(), -1)
        out.append(float(logp.gather(1, torch.tensor(cont).unsqueeze(1)).sum()))
    return out


def evaluate(models: dict[str, object], tokenizer, tasks: list[str], limit: int | None = None) -> dict:
    """{task: {model_name: {acc, acc_norm}}} and, per task, per-item correctness kept for pairing."""
    out = {}
    for name in tasks:
        items = load_task(name, limit)
        per_model = {}
        for label, model in models.items():
            acc, acc_norm = [], []
            for it in items:
                ll = choice_loglikelihoods(model, tokenizer, it)
                best = max(range(len(ll)), key=ll.__getitem__)
                norm = [v / max(1, len(c.encode())) for v, c in zip(ll, it.choices)]
                best_norm = max(range(len(norm)), key=norm.__getitem__)
                acc.append(float(best in it.correct))
                acc_norm.append(float(best_norm in it.correct))
            per_model[label] = {"acc": acc, "acc_norm": acc_norm}
        out[name] = per_model
    return out


def summarize(results: dict, baseline: str, candidate: str) -> dict:
    """Per task and averaged: accuracies with standard errors, and the paired drop in points."""
    tasks, drops = {}, []
    for name, per in results.items():
        b, c = per[baseline]["acc"], per[candidate]["acc"]
        diff = [x - y for x, y in zip(b, c)]  # paired per item: the drop's stderr is the diff's
        d = mean_with_se(diff)
        tasks[name] = {"acc_baseline": mean_with_se(b), "acc_candidate": mean_with_se(c),
                       "acc_norm_baseline": mean_with_se(per[baseline]["acc_norm"]),
                       "acc_norm_candidate": mean_with_se(per[candidate]["acc_norm"]),
                       "accuracy_drop_points": {"point": 100 * d["point"], "stderr": 100 * d["stderr"], "n": d["n"]}}
        drops.append(diff)
    flat = [x for d in drops for x in d]
    overall = mean_with_se(flat)
    return {"tasks": tasks, "accuracy_drop_points": {"point": 100 * overall["point"] if flat else None,
                                                     "stderr": 100 * overall["stderr"] if flat else None,
                                                     "ci_upper": 100 * (overall["point"] + 1.96 * overall["stderr"]) if flat else None,
                                                     "n": overall["n"]}}
