"""The eval's work as Ray tasks (`quantpipe eval --ray ADDRESS`).

- Quality: the held-out texts are cut into contiguous shards, one task per shard; a task
  loads the baseline and every candidate once and scores its texts (the baseline's
  logits serve every candidate, as in the local path). Scoring is per text and does not
  depend on batch or thread count, so the shards' per-text statistics, concatenated in
  text order, are the ones the local run computes, and the report's CIs are computed from
  them on the driver.
- Generations, multiple-choice and lm-eval items: each model's run in one of the shard
  tasks (model j in shard j mod shards), on the models it has loaded; compared on the driver.
- Latency: the whole A/B is one task that takes every CPU of a node, so its servers never
  share a machine with other tasks; with `--ray-gpus` it is placed on a GPU node.

Artifacts and the calibration set are read by path: every node must see the same files
(shared storage). Each task re-hashes what it loaded and the driver refuses a result
computed on other bytes than the ones the report names.
"""

from __future__ import annotations

import torch

from quantpipe.distributed import TASK_OVERHEAD_BYTES, TaskResources, cluster_cpus, float32_model_bytes, run_tasks
from quantpipe.eval.scorer import QualityScores, score_many
from quantpipe.formats.artifact import artifact_sha256, model_sha256
from quantpipe.manifest import StageError


def _load(model: str | None, expected_sha: str, artifact: bool):
    from quantpipe.runtime.model.loader import load_model, resolve_model_path

    sha = artifact_sha256(model) if artifact else model_sha256(resolve_model_path(model))
    if sha != expected_sha:
        raise StageError(f"ray: {model or 'the default model'} has sha256 {sha[:12]} on this node, "
                         f"{expected_sha[:12]} where the eval started; every node must see the same files")
    return load_model(model, torch.float32)


def score_shard(baseline: str | None, baseline_sha: str, candidates: list[str], shas: list[str], texts: list[str],
                max_tokens: int, extras_for: list[int], prompts: list[list[int]], suite) -> dict:
    """One shard: every candidate's per-text statistics on `texts`, and the suite's extras
    (generations, task items) of the models `extras_for` (0 the baseline, j candidate j - 1),
    computed on the models already loaded, with the baseline's tokenizer as the local path."""
    from quantpipe.eval.stage import suite_extras

    base, _, tokenizer = _load(baseline, baseline_sha, artifact=False)
    if tokenizer is None:
        raise StageError("--baseline: the quality suite needs the model's tokenizer")
    models = [_load(c, sha, artifact=True)[0] for c, sha in zip(candidates, shas)]
    scores = [s.texts for s in score_many(base, models, tokenizer, texts, max_tokens=max_tokens)]
    loaded = [(base, baseline)] + list(zip(models, candidates))
    extras = {}
    for j in extras_for:
        model, name = loaded[j]
        extras[j] = suite_extras(model, tokenizer, name, prompts, suite)
    return {"texts": scores, "extras": extras}


def shards(n_texts: int, n: int) -> list[range]:
    """`n` contiguous ranges covering the texts, sizes differing by at most one."""
    n = max(1, min(n, n_texts))
    bounds = [round(i * n_texts / n) for i in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def quality_on_ray(ray, baseline: str | None, baseline_sha: str, candidates: list[str], shas: list[str],
                   texts: list[str], suite, resources: TaskResources):
    """(scores per candidate, the baseline's extras, each candidate's extras, what ran where).

    One task per shard, each loading every model once; model j's extras run in shard
    j mod shards, on the models that shard holds anyway."""
    from quantpipe.eval import generation
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    g = suite.generation
    prompts = generation.prompts_from(texts[: g["prompts"]], load_tokenizer(baseline)) if g["prompts"] else []
    cpus = cluster_cpus(ray)
    parts = shards(len(texts), max(1, int(cpus // resources.num_cpus)))
    models = 1 + len(candidates)
    need = TaskResources(resources.num_cpus, models * float32_model_bytes(baseline) + TASK_OVERHEAD_BYTES)
    outs = run_tasks(ray, score_shard, [(baseline, baseline_sha, candidates, shas, [texts[i] for i in part],
                                         suite.quality["max_tokens"], list(range(k, models, len(parts))), prompts,
                                         suite) for k, part in enumerate(parts)], need)
    scores = []
    for j in range(len(candidates)):
        texts_j = [t for out in outs for t in out["texts"][j]]
        scores.append(QualityScores(texts=texts_j, strata=["all"] * len(texts_j)))
    extras = {j: x for out in outs for j, x in out["extras"].items()}
    info = {"shards": len(parts), "texts_per_shard": [len(p) for p in parts], "cluster_cpus": cpus,
            "task": need.to_dict()}
    return scores, extras[0], [extras[j] for j in range(1, models)], info


def latency_on_ray(ray, baseline: str | None, candidates: list[str], rows: list[dict], cfg: dict,
                   resources: TaskResources) -> tuple[dict, dict]:
    """(the latency A/B, what its task declared). One task that takes a whole node, every CPU
    of the largest node with the GPUs asked for, so no other task shares the machine it
    measures on."""
    from quantpipe.eval.latency import latency_ab

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU", 0) >= resources.num_gpus]
    if not nodes:
        raise StageError(f"--ray-gpus {resources.num_gpus:g}: no node of the cluster has that many GPUs")
    cpus = max(n.get("CPU", 0) for n in nodes)
    # Servers load in bf16 where the CPU has it: half the float32 bytes per model, all models up at once.
    need = TaskResources(max(cpus, resources.num_cpus), (1 + len(candidates)) * float32_model_bytes(baseline) // 2
                         + TASK_OVERHEAD_BYTES, resources.num_gpus)
    (out,) = run_tasks(ray, latency_ab, [(baseline, candidates, rows, cfg)], need)
    return out, {"latency_task": need.to_dict()}
