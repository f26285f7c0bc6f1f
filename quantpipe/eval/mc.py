"""Multiple-choice accuracy by log-likelihood of each choice (lm-eval's `acc`/`acc_norm`).

Tasks are BIG-bench `task.json` files (see evals/mc/README.md), read by
`quantpipe.formats.bigbench`: the prompt built the way BIG-bench does and each choice the
continuation " " + choice. Both models see the same token ids, scored in float32 one
item per forward call (batch-invariant, as the perplexity scorer is).

The eval's multiple-choice section runs these items through lm-evaluation-harness (the
task files in evals/lm_eval_tasks/, `lm_eval_suite.score_mc`), whose quantpipe model scores
each request with `loglikelihoods` below; `summarize` turns the per-item results into the
report's section. `evaluate` is the same scoring without lm-eval, an independent check
that lm-eval builds and judges the items as BIG-bench does (tests, benchmarks/bench_lm_eval.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import quantpipe.evals
from quantpipe.eval.stats import mean_with_se, recovery_and_flips
from quantpipe.formats.bigbench import Item, read_task
from quantpipe.runtime.model.forward import continuation_logits

TASK_DIR = Path(quantpipe.evals.__file__).resolve().parent / "mc" / "bigbench"


def shipped_tasks() -> list[str]:
    return sorted(p.name.removesuffix(".json.gz") for p in TASK_DIR.glob("*.json.gz"))


def load_task(name: str, limit: int | None = None) -> list[Item]:
    path = TASK_DIR / f"{name}.json.gz"
    if not path.exists():
        raise ValueError(f"mc task {name!r} is not shipped; known: {', '.join(shipped_tasks())}")
    return read_task(path, limit)


@torch.inference_mode()
def loglikelihoods(model, tokenizer, context: str, continuations: list[str]) -> list[tuple[float, bool]]:
    """lm-eval's loglikelihood request for one context: (summed log-probability of the
    continuation's tokens, whether greedy decoding would produce exactly them) for each
    continuation, the context computed once. An empty context conditions on the BOS token
    (EOS where the model has none), as lm-eval's own models do."""
    ctx = tokenizer.encode(context)
    if not ctx:
        ctx = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_ids[0]]
    return token_loglikelihoods(model, ctx, [tokenizer.encode(c, add_special_tokens=False) for c in continuations])


@torch.inference_mode()
def token_loglikelihoods(model, context: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
    """`loglikelihoods` on token ids (float64 log-softmax of the float32 logits)."""
    out = []
    for lg, cont in zip(continuation_logits(model, context, continuations), continuations):
        logp = F.log_softmax(lg.double(), -1)
        target = torch.tensor(cont)
        out.append((float(logp.gather(1, target.unsqueeze(1)).sum()), bool((logp.argmax(-1) == target).all())))
    return out


def choice_loglikelihoods(model, tokenizer, item: Item) -> list[float]:
    """Summed log-probability of each choice's tokens (" " + choice) after the item's context."""
    return [ll for ll, _ in loglikelihoods(model, tokenizer, item.context, [" " + c for c in item.choices])]


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
                norm = [v / max(1, len(c)) for v, c in zip(ll, it.choices)]  # by characters, as lm-eval
                best_norm = max(range(len(norm)), key=norm.__getitem__)
                acc.append(float(best in it.correct))
                acc_norm.append(float(best_norm in it.correct))
            per_model[label] = {"acc": acc, "acc_norm": acc_norm}
        out[name] = per_model
    return out


def summarize(results: dict, baseline: str, candidate: str, replicates: int = 1000, seed: int = 0) -> dict:
    """Per task and over all items: accuracies with standard errors, the paired drop in
    points, and the recovery and flips with paired bootstrap CIs."""
    tasks, drops, base_all, cand_all = {}, [], [], []
    for name, per in results.items():
        b, c = per[baseline]["acc"], per[candidate]["acc"]
        diff = [x - y for x, y in zip(b, c)]  # paired per item: the drop's stderr is the diff's
        d = mean_with_se(diff)
        tasks[name] = {"acc_baseline": mean_with_se(b), "acc_candidate": mean_with_se(c),
                       "acc_norm_baseline": mean_with_se(per[baseline]["acc_norm"]),
                       "acc_norm_candidate": mean_with_se(per[candidate]["acc_norm"]),
                       "accuracy_drop_points": {"point": 100 * d["point"], "stderr": 100 * d["stderr"], "n": d["n"]},
                       **recovery_and_flips(b, c, replicates, seed)}
        drops.append(diff)
        base_all += b
        cand_all += c
    flat = [x for d in drops for x in d]
    overall = mean_with_se(flat)
    return {"tasks": tasks, **recovery_and_flips(base_all, cand_all, replicates, seed), "accuracy_drop_points": {"point": 100 * overall["point"] if flat else None,
                                                     "stderr": 100 * overall["stderr"] if flat else None,
                                                     "ci_upper": 100 * (overall["point"] + 1.96 * overall["stderr"]) if flat else None,
                                                     "n": overall["n"]}}
