"""`quantpipe eval`: A/B one or more candidate artifacts against their baseline.

Quality (teacher-forced perplexity, KL, agreement, per stratum with paired bootstrap
CIs), greedy generation agreement, and multiple-choice accuracy run in this process on
the runtime's model code in float32; latency serves each model with `quantpipe serve` in
turn (latency.py). Everything lands in one report.json (and report.html), written
through a temporary folder, with the sha256 of every input.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from quantpipe import distributed
from quantpipe.distributed import TaskResources
from quantpipe.eval import generation, lm_eval_suite, mc
from quantpipe.eval.scorer import score_many
from quantpipe.eval.stats import mean_with_se, quality_with_ci
from quantpipe.eval.suite import EvalSuite
from quantpipe.formats.artifact import artifact_sha256, model_sha256, read_manifest
from quantpipe.formats.calib_set import CalibSet
from quantpipe.formats.report import read_report
from quantpipe.manifest import MANIFEST_VERSION, StageError, code_version, sha256_file, staged_output, write_json

log = logging.getLogger("quantpipe.eval")
SCOPES = ("full", "quality", "latency")
KL_BINS = [0.0] + [10.0 ** e for e in np.arange(-6, 1.01, 0.5)]  # per-token KL histogram edges (nats)


def resolve_baseline(baseline: str | None, manifests: list[dict]) -> tuple[str | None, str]:
    """(model argument for the loader, its sha256); checks every candidate came from it."""
    from quantpipe.runtime.model.loader import resolve_model_path

    try:
        path = resolve_model_path(baseline)
    except ValueError as e:
        raise StageError(f"--baseline: {e}") from None
    sha = model_sha256(path)
    for m in manifests:
        src = m["source_model"]
        if src["sha256"] != sha:
            hint = "" if baseline else " (--baseline defaults to the default model; pass the source model)"
            raise StageError(f"--baseline {baseline or path}: sha256 {sha[:12]} is not the source model of "
                             f"{m['_path']} ({src['path']}, sha256 {src['sha256'][:12]}){hint}")
    return baseline, sha


def load_heldout(calib: str, max_texts: int, seed: int) -> tuple[list[dict], dict]:
    cs = CalibSet.open(calib)
    rows = cs.rows("heldout")
    if not rows:
        raise StageError(f"--calib {calib}: heldout.jsonl is empty")
    if len(rows) > max_texts:  # a seeded subset; the held-out set is already stratified
        keep = sorted(np.random.default_rng(seed).choice(len(rows), max_texts, replace=False))
        rows = [rows[i] for i in keep]
    return rows, {**cs.info("heldout"), "rows": len(rows)}


def stratum_groups(rows: list[dict]) -> dict[str, list[int]]:
    """Text indices per stratum value: one group per `dimension=value` of the calibration strata."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        for dim, value in sorted((r.get("strata") or {}).items()):
            groups[f"{dim}={value}"].append(i)
    return dict(sorted(groups.items()))


def kl_histogram(scores) -> list[int]:
    kl = np.concatenate([t.kl for t in scores.texts]) if scores.texts else np.zeros(0)
    return np.histogram(np.clip(kl, 0, KL_BINS[-1]), bins=KL_BINS)[0].tolist()


def quality_section(scores, groups: dict[str, list[int]], q: dict) -> dict:
    ci = dict(replicates=q["bootstrap"], seed=q["seed"])
    out = quality_with_ci(scores, list(range(len(scores.texts))), **ci)
    out["strata"] = {name: quality_with_ci(scores, idx, **ci) for name, idx in groups.items()}
    out["kl_histogram"] = {"edges": KL_BINS, "counts": kl_histogram(scores)}
    return out


def _memory(m: dict, artifact: str) -> dict:
    """Weight bytes from the manifest; KV bytes per token against a bf16 cache, from the artifact's format."""
    from quantpipe.formats.artifact import kv_cache_kind, read_config
    from quantpipe.runtime.model.config import ModelConfig
    from quantpipe.runtime.model.kv_cache import bytes_per_token

    b = m["bytes"]
    try:
        config = read_config(artifact)
        kind, static = kv_cache_kind(config.get("quantization_config") or {})
    except ValueError as e:
        raise StageError(f"--candidate {artifact}: {e}") from None
    mc = ModelConfig.from_hf(config)
    per_token = bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16, kind, static=static)
    ratio = per_token / bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16, "auto")
    files = sum(f.stat().st_size for f in Path(artifact).glob("*.safetensors"))
    return {"weight_bytes_ratio": b["ratio"], "quantized_linear_bytes": b["quantized_linears"],
            "bf16_linear_bytes": b["bf16_equivalent"], "kv_cache": m.get("kv_cache"),
            "kv_bytes_per_token_ratio": round(ratio, 4), "kv_bytes_per_token": per_token,
            "weight_file_bytes": files}


def suite_extras(model, tokenizer, model_arg: str | None, prompts: list[list[int]], suite: EvalSuite) -> dict:
    """What the suite asks of one model beyond teacher-forced scoring: greedy generations,
    multiple-choice items and lm-eval task items (compared with the baseline's by `_fill`)."""
    g, out = suite.generation, {}
    if prompts:
        out["generation"] = generation.greedy(model_arg, prompts, g["max_tokens"])
    if suite.mc["tasks"]:
        out["mc"] = lm_eval_suite.score_mc(model, tokenizer, model_arg, suite.mc["tasks"], suite.mc["limit"])
    if suite.lm_eval["tasks"]:
        out["lm_eval"] = lm_eval_suite.score_tasks(model, tokenizer, model_arg, suite.lm_eval)
    return out


def _fill(entry: dict, scores, groups: dict, base: dict, cand: dict, suite: EvalSuite, n_texts: int,
          calib: str) -> None:
    """A candidate's quality sections from its scores and extras against the baseline's."""
    q, g = suite.quality, suite.generation
    if len(scores.texts) != n_texts:
        raise StageError(f"--calib {calib}: {n_texts - len(scores.texts)} held-out texts are shorter than 2 tokens")
    entry["quality"] = quality_section(scores, groups, q)
    if "generation" in base:
        agree = generation.agreement(base["generation"], cand["generation"])
        entry["generation"] = {"prompts": len(base["generation"]), "max_tokens": g["max_tokens"],
                               "exact_match": mean_with_se(agree["exact"]),
                               "prefix_match_mean": mean_with_se(agree["prefix"])}
    if "mc" in base:
        for name in suite.mc["tasks"]:
            lm_eval_suite.check_identical(base["mc"][name]["request"], cand["mc"][name]["request"], f"mc task {name}")
        merged = {name: {"baseline": base["mc"][name], "candidate": cand["mc"][name]} for name in suite.mc["tasks"]}
        entry["mc"] = mc.summarize(merged, "baseline", "candidate", q["bootstrap"], q["seed"])
    if "lm_eval" in base:
        entry["lm_eval"] = lm_eval_suite.compare(base["lm_eval"], cand["lm_eval"], q["bootstrap"], q["seed"])


def evaluate(candidates: list[str], calib: str, out: str, baseline: str | None = None,
             suite: EvalSuite | None = None, scope: str = "full", overwrite: bool = False,
             ray: str | None = None, resources: TaskResources | None = None) -> dict:
    """Write report.json and report.html into `out`; returns the report.

    `ray` (or RAY_ADDRESS): a Ray cluster's address; the held-out texts are scored in shards
    and each model's generations and tasks run as Ray tasks there, the
    latency A/B as one task (eval/on_ray.py). The report's numbers are the same as this process's."""
    from quantpipe.runtime.model.loader import load_model

    t_start = time.perf_counter()
    suite = suite or EvalSuite.load()
    if scope not in SCOPES:
        raise StageError(f"scope must be one of {', '.join(SCOPES)}; got {scope!r}")
    if not candidates:
        raise StageError("--candidate: at least one artifact to evaluate")
    if len(set(map(os.path.realpath, candidates))) != len(candidates):
        raise StageError("--candidate: the same artifact is named twice")
    if Path(out).exists() and not overwrite:
        raise StageError(f"--out {out} already exists (pass --overwrite to replace it)")
    manifests = []
    for c in candidates:
        m = read_manifest(c, "--candidate")
        m["_path"] = c
        manifests.append(m)
    baseline, baseline_sha = resolve_baseline(baseline, manifests)
    q, g = suite.quality, suite.generation
    rows, heldout_info = load_heldout(calib, q["max_texts"], q["seed"])
    texts = [r["text"] for r in rows]
    groups = stratum_groups(rows)

    entries = [{"name": Path(c).name, "path": str(c), "sha256": artifact_sha256(c), "scheme": m["scheme"],
                "weights": m["weights"], "method": m["method"], "memory": _memory(m, c)}
               for c, m in zip(candidates, manifests)]
    where = distributed.address(ray)
    phases: dict[str, float] = {}
    ray_info = None
    with distributed.session(where) if where else contextlib.nullcontext() as cluster:
        if scope in ("full", "quality"):
            t = time.perf_counter()
            log.info("quality: %d candidate(s) against the baseline on %d held-out texts", len(candidates), len(texts))
            if cluster is not None:
                from quantpipe.eval.on_ray import quality_on_ray

                all_scores, base_x, cand_xs, ray_info = quality_on_ray(
                    cluster, baseline, baseline_sha, candidates, [e["sha256"] for e in entries], texts, suite,
                    resources or TaskResources())
            else:
                base_model, _, tokenizer = load_model(baseline, torch.float32)
                if tokenizer is None:
                    raise StageError("--baseline: the quality suite needs the model's tokenizer")
                prompts = generation.prompts_from(texts[: g["prompts"]], tokenizer) if g["prompts"] else []
                base_x = suite_extras(base_model, tokenizer, baseline, prompts, suite)
                # Every candidate is scored in one pass over the texts, so the baseline runs once per text.
                cand_models = [load_model(c, torch.float32)[0] for c in candidates]
                all_scores = score_many(base_model, cand_models, tokenizer, texts, max_tokens=q["max_tokens"])
                cand_xs = [suite_extras(m, tokenizer, c, prompts, suite) for m, c in zip(cand_models, candidates)]
                del base_model, cand_models
            for entry, scores, cand_x in zip(entries, all_scores, cand_xs):
                _fill(entry, scores, groups, base_x, cand_x, suite, len(texts), calib)
            del all_scores, base_x, cand_xs
            phases["quality_s"] = time.perf_counter() - t
        if scope in ("full", "latency"):
            from quantpipe.eval.latency import latency_ab

            _release_memory()  # the servers need it: scoring 9 candidates left this process at 17 GB
            t = time.perf_counter()
            if cluster is not None:
                from quantpipe.eval.on_ray import latency_on_ray

                lat, lat_info = latency_on_ray(cluster, baseline, candidates, rows, suite.latency,
                                               resources or TaskResources())
                ray_info = {**(ray_info or {}), **lat_info}
            else:
                lat = latency_ab(baseline, candidates, rows, suite.latency)
            for entry, section in zip(entries, lat["candidates"]):
                entry["latency"] = section
            phases["latency_s"] = time.perf_counter() - t

    report = {
        "stage": "eval", "manifest_version": MANIFEST_VERSION, "code_version": code_version(),
        "scope": scope, "suite": suite.to_dict(), "suite_path": suite.path,
        "baseline": {"model": baseline or "default", "sha256": baseline_sha},
        "heldout": heldout_info, "strata": {k: len(v) for k, v in groups.items()},
        "candidates": entries, "versions": _versions(),
    }
    if where:
        # Where it ran (not a quality number): the cluster, the shards, what each task declared.
        report["ray"] = {"address": where, **(ray_info or {}), "resources": (resources or TaskResources()).to_dict()}
    with staged_output(out, overwrite=overwrite) as tmp:
        from quantpipe.eval.html import report_html

        phases["total_s"] = time.perf_counter() - t_start
        report["time_s"] = {k: round(v, 1) for k, v in phases.items()}
        write_json(tmp / "report.json", report)
        (tmp / "report.html").write_text(report_html(report), encoding="utf-8")
    return report


def combine(quality_dir: str, latency_dir: str, candidate: str, out: str, overwrite: bool = False) -> dict:
    """One full-scope report for `candidate` from a quality-scope report (which may hold
    several candidates, scored in one pass) and a latency-scope report of that candidate.

    Both must come from the same baseline, held-out set, suite and artifact bytes; the
    full report records both parts' sha256, so a gate judging it judges what was measured."""
    parts = {"quality": read_report(quality_dir, "quality report"), "latency": read_report(latency_dir,
                                                                                         "latency report")}
    for (scope, rep), where in zip(parts.items(), (quality_dir, latency_dir)):
        if rep.get("scope") not in (scope, "full"):
            raise StageError(f"{scope} report {where}: its scope is {rep.get('scope')!r}, not {scope}")
    q, lat = parts["quality"], parts["latency"]
    for key in ("baseline", "heldout", "suite"):
        if q.get(key) != lat.get(key):
            raise StageError(f"cannot combine {quality_dir} and {latency_dir}: their {key} differ")
    entries = {}
    for scope, rep in parts.items():
        named = [c for c in rep["candidates"] if c["name"] == candidate]
        if len(named) != 1:
            raise StageError(f"{scope} report has no candidate {candidate!r} "
                             f"(has {', '.join(c['name'] for c in rep['candidates'])})")
        entries[scope] = named[0]
    if entries["quality"]["sha256"] != entries["latency"]["sha256"]:
        raise StageError(f"cannot combine: candidate {candidate} has sha256 {entries['quality']['sha256'][:12]} in "
                         f"the quality report and {entries['latency']['sha256'][:12]} in the latency report")
    entry = {**entries["quality"], "latency": entries["latency"]["latency"]}
    report = {**{k: v for k, v in q.items() if k not in ("candidates", "time_s")}, "scope": "full",
              "candidates": [entry], "code_version": code_version(),
              "time_s": {"quality_s": q.get("time_s", {}).get("quality_s"),
                         "latency_s": lat.get("time_s", {}).get("latency_s")},
              "parts": {scope: {"path": str(Path(d) / "report.json"), "sha256": sha256_file(Path(d) / "report.json")}
                        for scope, d in (("quality", quality_dir), ("latency", latency_dir))}}
    with staged_output(out, overwrite=overwrite) as tmp:
        from quantpipe.eval.html import report_html

        write_json(tmp / "report.json", report)
        (tmp / "report.html").write_text(report_html(report), encoding="utf-8")
    return report


def _release_memory() -> None:
    """Free the quality phase's tensors and hand the heap's free pages back to the OS.

    glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, so the
    per-text logits of many candidates stay resident after they are freed; malloc_trim
    returns them. Elsewhere than glibc this is only the garbage collection."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "safetensors", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
