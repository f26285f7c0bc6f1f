"""The eval's work as Ray tasks (`quantpipe eval --ray ADDRESS`).

- Quality: the held-out texts are cut into contiguous shards, one task per shard; a task
  loads the baseline and every candidate once and scores its texts (the baseline's
  logits serve every candidate, as in the local path). Scoring is per text and
  batch-invariant, so the shards' per-text statistics, concatenated in text order, are the
  ones the local run computes, and the report's CIs are computed from them on the driver.
- Generations, multiple-choice and lm-eval items: one task per model (the baseline's and
  each candidate's), compared on the driver.
- Latency: the whole A/B is one task, so its servers share one node and never a node with
  scoring; with `--ray-gpus` it is placed on a GPU node.

Artifacts and the calibration set are read by path: every node must see the same files
(shared storage). Each task re-hashes what it loaded and the driver refuses a result
computed on other bytes than the ones the report names.
"""

from __future__ import annotations

import torch

from quantpipe.distributed import TaskResources, float32_model_bytes, gather, run_tasks, submit
from quantpipe.eval.scorer import QualityScores, score_many
from quantpipe.formats.artifact import artifact_sha256, model_sha256
from quantpipe.manifest import StageError

OVERHEAD_BYTES = 1 << 30  # a worker process with torch imported, the logits of one text, the tokenizer


def _load(model: str | None, expected_sha: str, artifact: bool):
    from quantpipe.runtime.model.loader import load_model, resolve_model_path

    sha = artifact_sha256(model) if artifact else model_sha256(resolve_model_path(model))
    if sha != expected_sha:
        raise StageError(f"ray: {model or 'the default model'} has sha256 {sha[:12]} on this node, "
                         f"{expected_sha[:12]} where the eval started; every node must see the same files")
    return load_model(model, torch.float32)


def score_shard(baseline: str | None, baseline_sha: str, candidates: list[str], shas: list[str], texts: list[str],
                max_tokens: int) -> list[list]:
    """Every candidate's per-text statistics on `texts` (one shard)."""
    base, _, tokenizer = _load(baseline, baseline_sha, artifact=False)
    if tokenizer is None:
        raise StageError("--baseline: the quality suite needs the model's tokenizer")
    models = [_load(c, sha, artifact=True)[0] for c, sha in zip(candidates, shas)]
    return [s.texts for s in score_many(base, models, tokenizer, texts, max_tokens=max_tokens)]


def model_extras(model: str | None, sha: str, artifact: bool, baseline: str | None, prompts: list[list[int]],
                 suite) -> dict:
    """One model's generations and task items, tokenized as the local path does: with the baseline's tokenizer."""
    from quantpipe.eval.stage import suite_extras
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    loaded, _, own = _load(model, sha, artifact)
    return suite_extras(loaded, own if not artifact else load_tokenizer(baseline), model, prompts, suite)


def shards(n_texts: int, n: int) -> list[range]:
    """`n` contiguous ranges covering the texts, sizes differing by at most one."""
    n = max(1, min(n, n_texts))
    bounds = [round(i * n_texts / n) for i in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def quality_on_ray(ray, baseline: str | None, baseline_sha: str, candidates: list[str], shas: list[str],
                   texts: list[str], suite, resources: TaskResources):
    """(scores per candidate, the baseline's extras, each candidate's extras, what ran where)."""
    from quantpipe.eval import generation
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    g = suite.generation
    tokenizer = load_tokenizer(baseline)
    prompts = generation.prompts_from(texts[: g["prompts"]], tokenizer) if g["prompts"] else []
    per_model = float32_model_bytes(baseline)
    cpus = int(ray.cluster_resources().get("CPU", 0))
    parts = shards(len(texts), max(1, int(cpus // resources.num_cpus)))
    scoring = TaskResources(resources.num_cpus, (1 + len(candidates)) * per_model + OVERHEAD_BYTES)
    single = TaskResources(resources.num_cpus, per_model + OVERHEAD_BYTES)
    needs_extras = bool(prompts or suite.mc["tasks"] or suite.lm_eval["tasks"])
    # Submitted together: Ray runs the extras beside the shards wherever CPUs and memory allow.
    extras = submit(ray, model_extras, [(baseline, baseline_sha, False, baseline, prompts, suite)]
                    + [(c, sha, True, baseline, prompts, suite) for c, sha in zip(candidates, shas)],
                    single) if needs_extras else None
    scored = submit(ray, score_shard, [(baseline, baseline_sha, candidates, shas, [texts[i] for i in part],
                                        suite.quality["max_tokens"]) for part in parts], scoring)
    try:
        shard_out = gather(scored)
        xs = gather(extras) if extras else [{} for _ in range(1 + len(candidates))]
    except BaseException:
        for p in (scored, extras):
            if p:
                p.cancel()
        raise
    scores = []
    for j in range(len(candidates)):
        texts_j = [t for out in shard_out for t in out[j]]
        scores.append(QualityScores(texts=texts_j, strata=["all"] * len(texts_j)))
    info = {"shards": len(parts), "texts_per_shard": [len(p) for p in parts], "cluster_cpus": cpus,
            "scoring_task": scoring.to_dict(), "model_task": single.to_dict() if needs_extras else None}
    return scores, xs[0], xs[1:], info


def latency_on_ray(ray, baseline: str | None, candidates: list[str], rows: list[dict], cfg: dict,
                   resources: TaskResources) -> dict:
    """The latency A/B as one task: its own node's CPUs (and GPUs, where asked), never shared with scoring."""
    from quantpipe.eval.latency import latency_ab

    need = TaskResources(resources.num_cpus, (1 + len(candidates)) * float32_model_bytes(baseline) // 2 + OVERHEAD_BYTES,
                         resources.num_gpus)
    (out,) = run_tasks(ray, latency_ab, [(baseline, candidates, rows, cfg)], need)
    return out
