"""`quantpipe pipeline` (what `make quantize` runs): a gated search over a recipe's candidates.

calibrate once -> quantize every candidate -> kernels -> score quality for all candidates
in one pass over the held-out set -> order them by serving bytes -> the latency A/B of the
smallest candidate that passes every quality rule (the next one if it fails latency) ->
gate -> publish the first that passes the whole gate.

Outputs: artifacts/NAME/CANDIDATE (one artifact each); reports/NAME/quality (every
candidate's quality, one report), reports/NAME/latency-CANDIDATE, reports/NAME/CANDIDATE
(the full report the gate judged, and its verdict.json), reports/NAME/search.json and
search.html (every candidate side by side and the frontier).

A step is skipped when its output exists and the hash of its inputs (input files'
sha256, parameters, code version) equals the one recorded when it was made, so a rerun
redoes only what the change reaches. The keys live in .quantpipe/pipeline/NAME.json,
outside the outputs (an artifact's hash covers its files).
"""

from __future__ import annotations

import glob
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import click

from quantpipe.formats import calib_set
from quantpipe.formats.calib_set import CalibSet
from quantpipe.manifest import StageError, code_version, sha256_bytes, sha256_file
from quantpipe.pipeline.recipe import Candidate, PipelineRecipe

STATE_DIR = Path(".quantpipe/pipeline")
STEPS = 7


class Keys:
    def __init__(self, name: str):
        self.path = STATE_DIR / f"{name}.json"
        self.keys = json.loads(self.path.read_text()) if self.path.exists() else {}

    def fresh(self, step: str, key: str, output: Path) -> bool:
        return output.exists() and self.keys.get(step) == key

    def record(self, step: str, key: str) -> None:
        self.keys[step] = key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.keys, indent=1, sort_keys=True))


def _key(*parts) -> str:
    return sha256_bytes(json.dumps([code_version(), *parts], sort_keys=True, default=str).encode())


@dataclass
class Run:
    """What one pipeline run knows as it goes: the recipe, the source model, the step timings."""

    recipe: PipelineRecipe
    model: str | None
    policy: str
    suite: object = None  # EvalSuite, loaded once before any step runs
    src: str = ""
    src_sha: str = ""
    calib: str = ""
    heldout_sha: str = ""  # hashes computed once, for every step's key
    calib_sha: str = ""
    shas: dict = field(default_factory=dict)  # candidate name -> artifact sha256
    last_mixed: str | None = None  # the last mixed-precision artifact: its sensitivity table may serve the next
    keys: Keys = None
    times: dict = field(default_factory=dict)
    ray: str | None = None  # a Ray cluster's address: calibrate, quantize and eval run there
    resources: object = None  # TaskResources each Ray task declares (CPUs; GPUs for the latency A/B)

    def __post_init__(self) -> None:
        self.keys = Keys(self.recipe.name)

    @property
    def reports(self) -> Path:
        return Path("reports") / self.recipe.name

    def artifact(self, cand: Candidate) -> Path:
        return Path("artifacts") / self.recipe.name / cand.name

    def step(self, n: int, name: str, detail: str = "") -> float:
        click.secho(f"[{n}/{STEPS}] {name}" + (f": {detail}" if detail else ""), bold=True, err=True)
        return time.perf_counter()

    def done(self, t0: float, what: str, step: str) -> None:
        self.times[step] = self.times.get(step, 0.0) + time.perf_counter() - t0
        click.echo(f"      {what} ({time.perf_counter() - t0:.1f} s)", err=True)


DEFAULT_MODEL_NAME = "smollm2"


def model_name(model: str | None) -> str:
    """What a recipe without a name is called after: the registered model's name for
    models:/NAME@ALIAS, a PyPI model's name, else the file's or folder's (the default model's
    is "smollm2")."""
    if model is None or model == "smollm2-135m":
        return DEFAULT_MODEL_NAME
    if model.startswith("models:/"):
        return re.split(r"[@/]", model.removeprefix("models:/"), maxsplit=1)[0]
    stem = Path(model.rstrip("/")).name.removesuffix(".gguf")
    return re.sub(r"[^A-Za-z0-9._-]", "-", stem)[:100] or DEFAULT_MODEL_NAME


def run_pipeline(recipe: PipelineRecipe, model: str | None = None, ray: str | None = None,
                 resources=None) -> int:
    """Exit code: 0 a candidate passed the whole gate (and was published unless publishing is
    off), 1 every candidate judged failed, 2 none passed and at least one could not be judged.

    `ray` (or RAY_ADDRESS): a Ray cluster's address. Calibrate reads the logs through Ray
    Data, the candidates are quantized in parallel as Ray tasks, the eval's shards and
    latency A/B run there; every output is the one the local run writes."""
    from quantpipe import distributed
    from quantpipe.formats.artifact import artifact_sha256, model_sha256
    from quantpipe.gate import DEFAULT_POLICY
    from quantpipe.runtime.model.loader import resolve_model_path

    t_all = time.perf_counter()
    if recipe.name is None:
        recipe = replace(recipe, name=model_name(model))
    if model and model.startswith("models:/"):  # re-quantize a registered model's source with new traffic
        from quantpipe.registry import RegistryError, source_model

        try:
            model = source_model(model, recipe.registry)
        except RegistryError as e:
            raise StageError(f"MODEL: {e}") from None
        click.echo(f"MODEL: re-quantizing the source model of the registered version: {model}", err=True)
    run = Run(recipe, model, recipe.policy or str(DEFAULT_POLICY), ray=distributed.address(ray),
              resources=resources or distributed.TaskResources())
    try:
        run.src = resolve_model_path(model)
    except ValueError as e:
        raise StageError(f"MODEL: {e}") from None
    run.src_sha = model_sha256(run.src)
    _check_configs(run)
    run.calib = calibrate_step(run)
    opened = CalibSet.open(run.calib, "calibrate.set" if recipe.calib_set else "calibrate")
    run.calib_sha, run.heldout_sha = opened.sha256[calib_set.CALIB], opened.sha256[calib_set.HELDOUT]
    artifacts = quantize_all(run, recipe.candidates)
    run.shas = {name: artifact_sha256(a) for name, a in artifacts.items()}
    kernels_note = kernels_step(run)
    quality = quality_step(run, artifacts)

    from quantpipe.pipeline import search

    t = run.step(5, "select", f"{len(recipe.candidates)} candidate(s) by serving bytes, quality rules first")
    table = search.quality_table(quality, run.policy, recipe.kv_tokens)
    for row in table:
        failed = row["failed"][:2] + ([f"{len(row['failed']) - 2} more rules"] if len(row["failed"]) > 2 else [])
        click.echo(f"      {row['name']}: {search.gib(row['serving_bytes'])} "
                   f"({row['quality_result']}{': ' + '; '.join(failed) if failed else ''})", err=True)
    run.done(t, f"{sum(r['quality_result'] == 'pass' for r in table)} of {len(table)} pass the quality rules", "select")

    winner = None
    for row in (r for r in table if r["quality_result"] == "pass"):
        kernels_build(run, row, artifacts[row["name"]], kernels_note)
        code, verdict = latency_and_gate(run, row, artifacts[row["name"]])
        row.update(search.final_row(verdict))
        if code == 0:
            winner = row
            break
    uri = None
    try:
        uri = publish_step(run, winner, artifacts)
    finally:  # the search's report is written even when publishing fails
        doc = search.write_report(run.reports, recipe, table, winner, uri, run.policy)
    code = search.exit_code(table, winner)
    _summary(run, table, winner, uri, doc, code, time.perf_counter() - t_all)
    return code


def _check_configs(run: Run) -> None:
    """The suite and policy the later steps read, loaded (so validated) before any step runs:
    a bad key fails in a second, not after the candidates are quantized."""
    from quantpipe.eval.suite import EvalSuite
    from quantpipe.gate import load_policy

    run.suite = EvalSuite.load(run.recipe.suite)
    load_policy(run.policy)


def calibrate_step(run: Run) -> str:
    from quantpipe.calibrate import calibrate

    recipe = run.recipe
    if recipe.calib_set:
        t = run.step(1, "calibrate", f"using the existing set {recipe.calib_set}")  # opened and checked by the caller
        run.done(t, "given", "calibrate")
        return recipe.calib_set
    out = f"calib_sets/{recipe.name}-set"
    cfg = recipe.calib_config(out=out, model=run.model)
    cfg.ray = run.ray  # where it runs, not what it samples: not in the step's key
    files = sorted(f for pattern in cfg.logs for f in (glob.glob(pattern) or [pattern]))
    key = _key("calibrate", cfg.to_dict(), [(f, sha256_file(f)) for f in files if Path(f).is_file()], run.src_sha)
    t = run.step(1, "calibrate", f"{recipe.calib_recipe or 'recipe fields'} on {', '.join(files) or 'no logs'}")
    if run.keys.fresh("calibrate", key, Path(out)):
        run.done(t, f"unchanged, reusing {out}", "calibrate")
    else:
        calibrate(cfg, progress=True)
        run.keys.record("calibrate", key)
        run.done(t, f"wrote {out}", "calibrate")
    return out


def quantize_all(run: Run, candidates: list[Candidate]) -> dict[str, Path]:
    """Every candidate's artifact, reused where its key is unchanged. Locally one after
    another; on Ray as parallel tasks, mixed-precision candidates chained in one task so
    that each may reuse the previous one's sensitivity table, as in the local order."""
    jobs = []  # (candidate, key, calibration need, the mixed artifact before it) of those to quantize
    for cand in candidates:
        cfg = cand.config
        need = cfg.calibration_need()  # the stage's own answer: which configurations read calibration data
        key = _key("quantize", run.src_sha, run.calib_sha if need else None, cfg.to_dict())
        artifact = run.artifact(cand)
        if run.keys.fresh(f"quantize:{cand.name}", key, artifact):
            t = run.step(2, "quantize", cand.name)
            run.done(t, f"unchanged, reusing {artifact}", "quantize")
        else:
            jobs.append((cand, key, need, run.last_mixed if cfg.scheme == "mixed" else None))
        if cfg.scheme == "mixed":  # the stage reuses it only if measured alike
            run.last_mixed = str(artifact)
    if run.ray and jobs:
        _quantize_on_ray(run, jobs)
    else:
        for cand, key, need, earlier in jobs:
            t = run.step(2, "quantize", f"{cand.name}" + (f" (calibrated: {need})" if need else ""))
            manifest = quantize_group(run.model, [_job(run, cand, need, earlier)])[0]
            run.keys.record(f"quantize:{cand.name}", key)
            _report_quantized(run, cand, manifest, t)
    return {c.name: run.artifact(c) for c in candidates}


def _job(run: Run, cand: Candidate, need, earlier: str | None) -> tuple:
    return cand.config, run.calib if need else None, str(run.artifact(cand)), earlier


def quantize_group(model: str | None, jobs: list[tuple]) -> list[dict]:
    """`quantize` of each (config, calibration set or None, artifact path, sensitivity_from)
    in turn; the manifests in order. A Ray task runs one group."""
    from quantpipe.quantize import quantize

    return [quantize(model, cfg, calib, path, overwrite=True, sensitivity_from=earlier).manifest
            for cfg, calib, path, earlier in jobs]


def _report_quantized(run: Run, cand: Candidate, manifest: dict, t: float) -> None:
    reused = (manifest.get("mixed_precision") or {}).get("reused_from")
    note = f" (sensitivities reused from {reused['artifact']})" if reused else ""
    run.done(t, f"{manifest['weights']}: {manifest['bytes']['ratio']:.1%} of the bf16 bytes{note} -> "
                f"{run.artifact(cand)}", "quantize")


def _quantize_on_ray(run: Run, jobs: list[tuple]) -> None:
    from quantpipe import distributed

    chained = [j for j in jobs if j[0].config.scheme == "mixed"]
    groups = [[j] for j in jobs if j[0].config.scheme != "mixed"] + ([chained] if chained else [])
    t = run.step(2, "quantize", f"{len(jobs)} candidate(s) as {len(groups)} Ray task(s) on {run.ray}")
    # A task holds the source model in float32, its quantized copy and the calibration activations.
    need = distributed.TaskResources(run.resources.num_cpus, 3 * distributed.float32_model_bytes(run.model)
                                     + distributed.TASK_OVERHEAD_BYTES)
    calls = [(run.model, [_job(run, cand, nd, earlier) for cand, _, nd, earlier in group]) for group in groups]
    with distributed.session(run.ray) as ray:
        manifests = distributed.run_tasks(ray, quantize_group, calls, need)
    for group, done in zip(groups, manifests):
        for (cand, key, _, _), manifest in zip(group, done):
            run.keys.record(f"quantize:{cand.name}", key)
            _report_quantized(run, cand, manifest, t)


def kernels_step(run: Run) -> str | None:
    """None when kernels are built (CUDA, build: auto) for each candidate that reaches the
    latency A/B; otherwise why they are not."""
    import torch

    t = run.step(3, "kernels")
    if run.recipe.kernels_build == "off":
        note = "skipped: the recipe sets kernels.build off"
    elif not torch.cuda.is_available():
        note = ("skipped on CPU (no CUDA device): the Triton kernels are built for CUDA; on CPU the runtime "
                "serves through its own C++ and torch kernels, which need no build")
    else:
        note = None
    run.done(t, note or "on CUDA: built and verified for each candidate before its latency A/B", "kernels")
    return note


def kernels_build(run: Run, row: dict, artifact: Path, note: str | None) -> None:
    if note is not None:
        row["kernels"] = note
        return
    from quantpipe.kernels.build import build

    t = run.step(3, "kernels", f"build and verify for {row['name']}")
    try:
        report = build(artifact, "cuda", echo=lambda m: click.echo(f"      {m}", err=True))
    except StageError as e:
        raise StageError(f"kernels for {row['name']}: {e}") from None
    row["kernels"] = f"built: {len(report.get('cases', []))} cases on {report.get('device', {}).get('name')}"
    run.done(t, row["kernels"], "kernels")


def quality_step(run: Run, artifacts: dict[str, Path]) -> dict:
    """Every candidate's quality in one pass over the held-out set (the baseline runs once per text)."""
    from quantpipe.eval.stage import evaluate
    from quantpipe.formats.report import read_report

    out = run.reports / "quality"
    key = _key("quality", run.shas, run.heldout_sha, run.suite.to_dict(), run.src_sha)
    t = run.step(4, "eval quality", f"{len(artifacts)} candidate(s) against the source model on {run.calib}")
    if run.keys.fresh("quality", key, out / "report.json"):
        run.done(t, f"unchanged, reusing {out}", "eval")
        return read_report(out)
    report = evaluate([str(a) for a in artifacts.values()], run.calib, str(out), run.model, run.suite, "quality",
                      overwrite=True, ray=run.ray, resources=run.resources)
    run.keys.record("quality", key)
    run.done(t, f"wrote {out}/report.json", "eval")
    return report


def latency_and_gate(run: Run, row: dict, artifact: Path) -> tuple[int, dict]:
    """The candidate's latency A/B, its full report (quality + latency) and the gate's verdict on it."""
    from quantpipe.eval.stage import combine, evaluate
    from quantpipe.gate import gate
    from quantpipe.pipeline.search import failed_rules

    lat_dir, full = run.reports / f"latency-{row['name']}", run.reports / row["name"]
    key = _key("latency", run.shas[row["name"]], run.heldout_sha, run.suite.to_dict(), run.src_sha)
    t = run.step(6, "eval latency", f"{row['name']} against the source model, served in turn")
    if run.keys.fresh(f"latency:{row['name']}", key, lat_dir / "report.json"):
        run.done(t, f"unchanged, reusing {lat_dir}", "eval")
    else:
        evaluate([str(artifact)], run.calib, str(lat_dir), run.model, run.suite, "latency", overwrite=True,
                 ray=run.ray, resources=run.resources)
        run.keys.record(f"latency:{row['name']}", key)
        run.done(t, f"wrote {lat_dir}/report.json", "eval")
    combine(str(run.reports / "quality"), str(lat_dir), row["name"], str(full), overwrite=True)
    t = run.step(6, "gate", f"{row['name']}: {run.policy}")
    code, verdict = gate(str(full), run.policy, artifact=str(artifact))
    run.done(t, f"verdict {verdict['verdict']}", "gate")
    for line in failed_rules(verdict["rules"]):
        click.echo(f"      not passed: {line}", err=True)
    return code, verdict


def publish_step(run: Run, winner: dict | None, artifacts: dict[str, Path]) -> str | None:
    from quantpipe.registry import publish, resolve_registry_uri, version_with_artifact

    recipe = run.recipe
    t = run.step(7, "publish")
    if winner is None:
        run.done(t, "not published: no candidate passed the gate", "publish")
        return None
    if not recipe.publish:
        run.done(t, f"skipped (publishing off): {winner['name']} passed, nothing was registered", "publish")
        return None
    reg, name = resolve_registry_uri(recipe.registry), recipe.publish_name or recipe.name
    artifact = artifacts[winner["name"]]
    existing = version_with_artifact(name, run.shas[winner["name"]], reg)
    if existing:
        run.done(t, f"already published as {existing}", "publish")
        return existing
    r = publish(str(artifact), str(run.reports / winner["name"] / "verdict.json"), name, reg, run.policy,
                source_model=run.src)
    run.done(t, f"{r['uri']} (alias candidate) in {reg}", "publish")
    return r["uri"]


def _summary(run: Run, table: list[dict], winner: dict | None, uri: str | None, doc: dict, code: int,
             total: float) -> None:
    from quantpipe.pipeline import search

    lines = [f"\nreport:  {run.reports}/search.html"]
    if winner:
        lines.append(f"winner:  {winner['name']} ({search.gib(winner['serving_bytes'])} serving, "
                     f"{winner['verdict']}: {winner['rules_met']} of {winner['rules']} rules met)")
        lines.append(f"why:     {doc['why']}")
    else:
        closest = doc.get("closest")
        lines.append("winner:  none" + (f"; closest {closest['name']}, failing: {'; '.join(closest['failed'])}"
                                        if closest else ""))
    lines.append(f"verdict: {('pass' if code == 0 else 'fail' if code == 1 else 'cannot_judge')}")
    lines.append(f"model:   {uri or 'not published'}")
    lines.append(f"time:    {total:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in run.times.items()) + ")")
    click.echo("\n".join(lines))
