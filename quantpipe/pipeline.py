"""`quantpipe pipeline` (what `make quantize` runs): calibrate -> quantize -> kernels ->
eval -> gate -> publish, each stage reading the previous one's files.

A stage is skipped when its output exists and the hash of its inputs (input files'
sha256, parameters, code version) equals the one recorded when it was made, so rerunning
after a change redoes only what the change reaches. The keys live in
.quantpipe/pipeline/NAME.json, outside the outputs (an artifact's hash covers its files).
"""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path

import click

from quantpipe.manifest import StageError, code_version, sha256_bytes, sha256_file

STATE_DIR = Path(".quantpipe/pipeline")


class Keys:
    def __init__(self, name: str):
        self.path = STATE_DIR / f"{name}.json"
        self.keys = json.loads(self.path.read_text()) if self.path.exists() else {}

    def fresh(self, stage: str, key: str, output: Path) -> bool:
        return output.exists() and self.keys.get(stage) == key

    def record(self, stage: str, key: str) -> None:
        self.keys[stage] = key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.keys, indent=1, sort_keys=True))


def _key(*parts) -> str:
    return sha256_bytes(json.dumps([code_version(), *parts], sort_keys=True, default=str).encode())


def _stage(n: int, name: str, detail: str = "") -> float:
    click.secho(f"[{n}/6] {name}" + (f": {detail}" if detail else ""), bold=True, err=True)
    return time.perf_counter()


def _done(t0: float, what: str, times: dict, stage: str) -> None:
    times[stage] = time.perf_counter() - t0
    click.echo(f"      {what} ({times[stage]:.1f} s)", err=True)


def run_pipeline(model: str | None, scheme: str, method: str, group_size: int | None, logs: list[str],
                 recipe: str, calib: str | None, policy: str, suite: str | None, name: str,
                 registry_uri: str | None, publish_to: str | None = None, publish_model: bool = True) -> int:
    from quantpipe.artifact import artifact_sha256, model_sha256
    from quantpipe.calibrate import CalibConfig, calibrate
    from quantpipe.eval.stage import evaluate
    from quantpipe.eval.suite import EvalSuite
    from quantpipe.gate import gate
    from quantpipe.quantize import QuantConfig, quantize
    from quantpipe.registry import DEFAULT_REGISTRY, publish
    from quantpipe.runtime.model.loader import resolve_model_path

    keys, times, t_all = Keys(name), {}, time.perf_counter()
    try:
        src = resolve_model_path(model)
    except ValueError as e:
        raise StageError(f"MODEL: {e}") from None
    src_sha = model_sha256(src)

    # 1. calibrate
    if calib:
        t = _stage(1, "calibrate", f"using the existing set {calib}")
        if not (Path(calib) / "heldout.jsonl").exists():
            raise StageError(f"CALIB {calib}: not a calibration set (no heldout.jsonl)")
        _done(t, "given", times, "calibrate")
    else:
        calib = f"calib_sets/{name}-set"
        files = sorted(f for pattern in logs for f in (glob.glob(pattern) or [pattern]))
        key = _key("calibrate", sha256_file(recipe), [(f, sha256_file(f)) for f in files if Path(f).is_file()],
                   files, src_sha)
        t = _stage(1, "calibrate", f"{recipe} on {', '.join(files) or 'the recipe logs'}")
        if keys.fresh("calibrate", key, Path(calib)):
            _done(t, f"unchanged, reusing {calib}", times, "calibrate")
        else:
            calibrate(CalibConfig.from_recipe(recipe, logs=files or None, out=calib, model=model, overwrite=True),
                      progress=True)
            keys.record("calibrate", key)
            _done(t, f"wrote {calib}", times, "calibrate")

    # 2. quantize
    artifact = Path("artifacts") / name
    qcfg = QuantConfig(scheme=scheme, method=method, group_size=group_size)
    key = _key("quantize", src_sha, sha256_file(Path(calib) / "calib.jsonl"), qcfg.to_dict())
    t = _stage(2, "quantize", f"{scheme} {method}" + (f" group {group_size}" if group_size else ""))
    if keys.fresh("quantize", key, artifact):
        _done(t, f"unchanged, reusing {artifact}", times, "quantize")
    else:
        needs_calib = method == "gptq" or scheme == "mixed" or scheme == "W8A8"
        art = quantize(model, qcfg, calib if needs_calib else None, str(artifact), overwrite=True)
        keys.record("quantize", key)
        _done(t, f"{art.manifest['weights']}: {art.manifest['bytes']['ratio']:.1%} of the bf16 bytes -> {artifact}",
              times, "quantize")

    # 3. kernels: the Triton kernels are built for CUDA devices only
    t = _stage(3, "kernels")
    import torch

    if torch.cuda.is_available():  # the build stage (kernels issue) does not exist yet: say so, do not pretend
        _done(t, "skipped: this version has no Triton kernel build; CUDA serves through dequantized weights",
              times, "kernels")
    else:
        _done(t, "skipped on CPU (no CUDA device): the CPU kernels need no build", times, "kernels")

    # 4. eval
    report = Path("reports") / name
    suite_obj = EvalSuite.load(suite)
    key = _key("eval", artifact_sha256(artifact), sha256_file(Path(calib) / "heldout.jsonl"),
               suite_obj.to_dict(), src_sha)
    t = _stage(4, "eval", f"{artifact} against {Path(src).name} on {calib}")
    if keys.fresh("eval", key, report / "report.json"):
        _done(t, f"unchanged, reusing {report}", times, "eval")
    else:
        evaluate([str(artifact)], calib, str(report), model, suite_obj, "full", overwrite=True)
        keys.record("eval", key)
        _done(t, f"wrote {report}/report.json and report.html", times, "eval")

    # 5. gate
    t = _stage(5, "gate", policy)
    code, verdict = gate(str(report), policy, artifact=str(artifact))
    failed = [r for r in verdict["rules"] if r["result"] in ("fail", "cannot_judge")]
    _done(t, f"verdict {verdict['verdict']}", times, "gate")
    for r in failed:
        value = f"{r['value']:.4g}" if "value" in r else r.get("reason", "")
        click.echo(f"      {r['result'].upper()}: {r['metric']} ({r['compare']}) = {value}, needs {r['op']} "
                   f"{r['threshold']:g}", err=True)

    # 6. publish
    t = _stage(6, "publish")
    uri = None
    if code != 0:
        _done(t, "not published: the gate did not pass", times, "publish")
    elif not publish_model:
        _done(t, "skipped (--no-publish): the verdict passed, nothing was registered", times, "publish")
    else:
        reg = registry_uri or DEFAULT_REGISTRY
        existing = _published(reg, publish_to or name, artifact_sha256(artifact))
        if existing:
            uri = existing
            _done(t, f"already published as {uri}", times, "publish")
        else:
            r = publish(str(artifact), str(report / "verdict.json"), publish_to or name, reg, policy)
            uri = r["uri"]
            _done(t, f"{uri} (alias candidate) in {reg}", times, "publish")
    total = time.perf_counter() - t_all
    click.echo(f"\nreport:  {report}/report.html\nverdict: {verdict['verdict']} "
               f"({len(verdict['rules']) - len(failed)} of {len(verdict['rules'])} rules met)\n"
               f"model:   {uri or 'not published'}\ntime:    {total:.0f} s ("
               + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + ")")
    return code


def _published(registry_uri: str, name: str, sha: str) -> str | None:
    """models:/NAME/V of a version already holding this artifact, if any."""
    from quantpipe.registry.publish import _client

    client = _client(registry_uri)
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except Exception:  # noqa: BLE001 - no such model yet
        return None
    for v in versions:
        if v.tags.get("quantpipe.artifact_sha256") == sha:
            return f"models:/{name}/{v.version}"
    return None


@click.command("pipeline", help="calibrate -> quantize -> kernels -> eval -> gate -> publish; reuses unchanged stages.")
@click.argument("model", required=False, default=None)
@click.option("--scheme", default="W4A16", show_default=True)
@click.option("--method", default="gptq", show_default=True)
@click.option("--group-size", type=int, default=None)
@click.option("--logs", multiple=True, help="request logs [default: the recipe's]")
@click.option("--recipe", default="calib_sets/recipes/sample.yaml", show_default=True)
@click.option("--calib", default=None, help="an existing calibration set instead of --logs/--recipe")
@click.option("--policy", default=None, help="gate policy [default: evals/gates/default.yaml]")
@click.option("--suite", default=None, help="eval suite [default: evals/suites/default.yaml]")
@click.option("--name", required=True, help="artifacts/NAME, reports/NAME, and the registered model name")
@click.option("--registry-uri", default=None, help="[default: sqlite:///.quantpipe/registry.db]")
@click.option("--publish/--no-publish", "publish_model", default=True, show_default=True,
              help="--no-publish stops after the gate (a CI run on a pull request)")
def pipeline_command(model, scheme, method, group_size, logs, recipe, calib, policy, suite, name, registry_uri,
                     publish_model) -> int:
    from quantpipe.gate import DEFAULT_POLICY

    try:
        return run_pipeline(model, scheme, method, group_size, list(logs), recipe, calib,
                            policy or str(DEFAULT_POLICY), suite, name, registry_uri, None, publish_model)
    except StageError as e:
        click.echo(f"quantpipe pipeline: {e}", err=True)
        return 2
