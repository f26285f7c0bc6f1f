"""publish / promote / rollback / resolve against an MLflow registry (sqlite or HTTP)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from quantpipe.formats.artifact import artifact_sha256, read_manifest
from quantpipe.formats.report import read_report, read_verdict
from quantpipe.manifest import StageError, code_version, sha256_file

log = logging.getLogger("quantpipe.registry")
DEFAULT_REGISTRY = "sqlite:///.quantpipe/registry.db"
EXPERIMENT = "quantpipe"
# A registry that went away should fail a publish in seconds, not after MLflow's default
# of 7 retries with exponential backoff (minutes); transient errors still get retried.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


class RegistryError(StageError):
    """The registry refused or could not be reached; the message names what and why."""


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")  # a registered model's name (and a folder name)
MODEL_URI = re.compile(r"models:/([^/@]+)(?:@([^/]+)|/(\d+))")  # models:/NAME@ALIAS or models:/NAME/VERSION


def resolve_registry_uri(given: str | None = None) -> str:
    """The registry to use: the one given, else MLFLOW_TRACKING_URI (as MLflow's own tools
    do), else the local sqlite store."""
    return given or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_REGISTRY


def _client(uri: str):
    import mlflow
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    elif uri.startswith(("http://", "https://")):
        check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _experiment(client, uri: str) -> str:
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is not None:
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:///"):  # artifacts beside the database, not in the working directory
        location = Path(uri.removeprefix("sqlite:///")).resolve().parent.joinpath("mlartifacts").as_uri()
    try:
        return client.create_experiment(EXPERIMENT, artifact_location=location)
    except Exception:  # noqa: BLE001 - created meanwhile by a concurrent publish
        exp = client.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            raise
        return exp.experiment_id


def _metric_name(path: str) -> str:
    # MLflow allows letters, digits, _ - . / and space in metric names.
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", path)


def flatten_metrics(entry: dict) -> dict[str, float]:
    """Every number of a report's candidate section (per stratum too) as MLflow metrics."""
    out: dict[str, float] = {}

    def walk(obj, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k in ("kl_histogram", "baseline_runs", "candidate_runs"):
                    continue
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and obj == obj:
            out[_metric_name(path.replace(".point", ""))] = float(obj)

    from quantpipe.gate import SECTIONS  # the report's metric sections, as gate rules name them

    for section in SECTIONS:
        if section in entry:
            walk(entry[section], section)
    return out


def check_verdict(artifact: str, verdict: dict, policy: str, allow_partial: bool) -> None:
    if verdict.get("verdict") != "pass":
        failed = [r["metric"] for r in verdict.get("rules", []) if r.get("result") in ("fail", "cannot_judge")]
        raise StageError(f"--verdict: the gate's verdict is {verdict.get('verdict')!r}, not pass "
                         f"(rules: {', '.join(failed[:6]) or 'none'}); only passing artifacts are published")
    current = artifact_sha256(artifact)
    if verdict["candidate"]["sha256"] != current:
        raise StageError(f"--verdict: it judged sha256 {verdict['candidate']['sha256'][:12]}, but {artifact} is now "
                         f"{current[:12]}: the artifact changed after its eval (or the verdict is another's)")
    want = sha256_file(policy)
    if verdict["policy"]["sha256"] != want:
        raise StageError(f"--verdict: judged by policy {verdict['policy']['path']} (sha256 "
                         f"{verdict['policy']['sha256'][:12]}), not the configured {policy} ({want[:12]})")
    if verdict.get("scope") != "full" and not allow_partial:
        raise StageError(f"--verdict: its scope is {verdict.get('scope')!r}; publishing needs a full eval "
                         f"(quality and latency), or --allow-partial")


def rejudge(verdict: dict, policy: str) -> tuple[dict, dict]:
    """(report, candidate entry) of a verdict, trusted only after checking: the report is the
    one the verdict judged (its sha256), and the policy judges it again to the same results.
    A verdict file edited to say pass, or a report edited after its verdict, is refused."""
    from quantpipe.gate import judge, load_policy

    ref = verdict.get("report") or {}
    rpath = Path(ref.get("path", ""))
    if not rpath.is_file():
        raise StageError(f"--verdict: its report {rpath} is missing")
    got = sha256_file(rpath)
    if got != ref.get("sha256"):
        raise StageError(f"--verdict: its report {rpath} has sha256 {got[:12]}, not the "
                         f"{str(ref.get('sha256'))[:12]} it judged: the report changed after its verdict")
    report = read_report(rpath.parent, "--verdict: its report")
    sha = verdict["candidate"]["sha256"]
    entry = next((c for c in report.get("candidates", []) if c.get("sha256") == sha), None)
    if entry is None:
        raise StageError(f"--verdict: its report {rpath} has no candidate with sha256 {sha[:12]}")
    rows = judge(report, entry, load_policy(policy)[0])
    bad = [r for r in rows if r["result"] in ("fail", "cannot_judge")]
    if bad:
        raise StageError(f"--verdict says {verdict.get('verdict')!r}, but judged again with {policy} the report gives "
                         f"{bad[0]['result']} for {bad[0]['metric']} ({len(bad)} rule(s) not passed)")
    mine = sorted((r["metric"], r["compare"], r["result"]) for r in rows)
    theirs = sorted((r.get("metric"), r.get("compare"), r.get("result")) for r in verdict.get("rules", []))
    if mine != theirs:
        raise StageError(f"--verdict: its rules are not what {policy} gives on its report judged again "
                         f"({len(theirs)} recorded, {len(mine)} now); judge it again with `quantpipe gate`")
    return report, entry


def publish(artifact: str, verdict_path: str, name: str, registry_uri: str = DEFAULT_REGISTRY,
            policy: str | None = None, allow_partial: bool = False, source_model: str | None = None) -> dict:
    """Log a run and register a version with alias `candidate`; all of it, or none of it.

    Only a verdict that passes under `policy` for the artifact's current sha256, whose report
    is unchanged and judges to the same results again (`rejudge`), is published.

    `source_model`: where the model the artifact was quantized from lives, recorded on the
    version so that a later pipeline can re-quantize it (`quantpipe pipeline models:/NAME@champion`)."""
    import mlflow

    from quantpipe.gate import DEFAULT_POLICY
    from quantpipe.registry.pyfunc import PREDICT_PARAMS, QuantpipeModel

    if not MODEL_NAME.fullmatch(name or ""):
        raise StageError(f"--name {name!r}: letters, digits, '_', '.', '-' (at most 100, starting alphanumeric)")
    manifest = read_manifest(artifact, "artifact")
    verdict = read_verdict(verdict_path)
    check_verdict(artifact, verdict, str(policy or DEFAULT_POLICY), allow_partial)
    report_path = Path(verdict["report"]["path"])
    report, entry = rejudge(verdict, str(policy or DEFAULT_POLICY))
    calib = report.get("heldout", {}).get("path")

    client = _client(registry_uri)
    try:
        exp_id = _experiment(client, registry_uri)
    except Exception as e:  # noqa: BLE001
        raise RegistryError(f"--registry-uri {registry_uri}: unreachable or refused: {e}"[:500]) from None
    params = {"scheme": manifest["scheme"], "weights": manifest["weights"], "method": manifest["method"],
              "group_size": manifest.get("group_size"), "calibration_sha256": manifest["calibration"].get("sha256"),
              "heldout_sha256": report["heldout"]["sha256"], "source_model_sha256": manifest["source_model"]["sha256"],
              "policy_sha256": verdict["policy"]["sha256"], "artifact_sha256": verdict["candidate"]["sha256"],
              "code_version": code_version(), "quantize_code_version": manifest["code_version"]}
    tags = {"quantpipe.verdict": verdict["verdict"], "quantpipe.scope": verdict["scope"],
            "quantpipe.partial": str(verdict["scope"] != "full").lower(), "quantpipe.policy": verdict["policy"]["name"]}
    run = client.create_run(exp_id, tags={**tags, "mlflow.runName": f"publish {name}"}, run_name=f"publish {name}")
    run_id, version = run.info.run_id, None
    try:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        flat = flatten_metrics(entry)
        metrics = [Metric(k, v, now, 0) for k, v in flat.items()]
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()], tags=[], metrics=[])
        for i in range(0, len(metrics), 900):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(run_id, metrics=metrics[i:i + 900])
        for f in ("report.json", "report.html", "verdict.json"):
            if (report_path.parent / f).exists():
                client.log_artifact(run_id, str(report_path.parent / f), "eval")
        client.log_text(run_id, json.dumps(verdict, indent=1), "eval/verdict-published.json")
        if calib:
            for f in ("manifest.json", "coverage.html"):
                if (Path(calib) / f).exists():
                    client.log_artifact(run_id, str(Path(calib) / f), "calibration")
        from mlflow.models import infer_signature

        signature = infer_signature(["prompt"], ["completion"], params=PREDICT_PARAMS)
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(name="model", python_model=QuantpipeModel(), signature=signature,
                                           artifacts={"artifact": str(artifact)}, pip_requirements=["quantpipe"])
        headline = {k: v for k, v in flat.items()
                    if k in ("quality.ppl_delta_pct", "quality.kl_mean", "quality.top1_agreement",
                             "memory.weight_bytes_ratio", "latency.tpot_p50_ratio", "mc.accuracy_drop_points",
                             "mc.flips_pct")}
        vtags = {**tags, "quantpipe.artifact_sha256": verdict["candidate"]["sha256"],
                 "quantpipe.source_model_sha256": manifest["source_model"]["sha256"],
                 **{f"quantpipe.{k}": f"{v:.6g}" for k, v in headline.items()}}
        if source_model:
            vtags["quantpipe.source_model_path"] = os.path.abspath(source_model)
        try:
            client.create_registered_model(name)
        except Exception as e:  # noqa: BLE001 - it exists (or a concurrent publish made it)
            if "RESOURCE_ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
                raise
        version = client.create_model_version(name, source=info.model_uri, run_id=run_id, tags=vtags,
                                              model_id=info.model_id).version
        client.set_registered_model_alias(name, "candidate", version)
        client.set_terminated(run_id, "FINISHED")
    except BaseException as e:
        _undo(client, name, version, run_id)
        if isinstance(e, Exception) and not isinstance(e, StageError):
            raise RegistryError(f"publish to {registry_uri} failed, nothing registered: {e}"[:800]) from None
        raise
    uri = f"models:/{name}/{version}"
    log.info("published %s as %s (alias candidate)", artifact, uri)
    return {"name": name, "version": int(version), "uri": uri, "run_id": run_id, "registry_uri": registry_uri}


def _undo(client, name: str, version, run_id: str) -> None:
    """Best effort: no version left behind, the run marked failed."""
    if version is not None:
        try:
            client.delete_model_version(name, version)
        except Exception:  # noqa: BLE001
            log.error("could not delete %s version %s after a failed publish", name, version)
    try:
        client.set_terminated(run_id, "FAILED")
    except Exception:  # noqa: BLE001
        pass


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """A registry server that does not answer its health check is reported as unreachable at
    once (MLflow's client would retry for minutes and then say little more)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        return  # it answered: a server is there (auth and paths are the client's business)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise RegistryError(f"registry {uri}: unreachable ({reason}); is `mlflow server` running there? "
                            f"(--registry-uri / MLFLOW_TRACKING_URI)") from None


_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def _lookup(fn, what: str):
    """fn()'s result; None when the registry says that it has no such thing. Any other failure
    (unreachable, refused, a server error) is a RegistryError that says so."""
    from mlflow.exceptions import MlflowException

    try:
        return fn()
    except MlflowException as e:
        if e.error_code in _NOT_FOUND:
            return None
        raise RegistryError(f"registry: looking up {what} failed ({e.error_code}: {str(e.message)[:200]})") from None
    except Exception as e:  # noqa: BLE001 - connection errors surface as requests' or urllib3's exceptions
        raise RegistryError(f"registry: looking up {what} failed ({type(e).__name__}: {str(e)[:200]})") from None


def _version(client, name: str, version) -> object:
    mv = _lookup(lambda: client.get_model_version(name, str(version)), f"{name} version {version}")
    if mv is None:
        raise RegistryError(f"model {name!r} has no version {version}")
    return mv


def _alias_version(client, name: str, alias: str) -> str | None:
    mv = _lookup(lambda: client.get_model_version_by_alias(name, alias), f"{name}@{alias}")
    return None if mv is None else str(mv.version)


def version_with_artifact(name: str, sha256: str, registry_uri: str = DEFAULT_REGISTRY) -> str | None:
    """models:/NAME/V of a version of `name` that holds the artifact with this sha256, if any."""
    client = _client(registry_uri)
    if _lookup(lambda: client.get_registered_model(name), f"model {name}") is None:
        return None
    versions = _lookup(lambda: client.search_model_versions(f"name='{name}'"), f"versions of {name}") or []
    for v in versions:
        if v.tags.get("quantpipe.artifact_sha256") == sha256:
            return f"models:/{name}/{v.version}"
    return None


def promote(name: str, version: int | str, registry_uri: str = DEFAULT_REGISTRY, reason: str = "") -> dict:
    client = _client(registry_uri)
    mv = _version(client, name, version)
    if mv.tags.get("quantpipe.verdict") != "pass":
        raise RegistryError(f"{name} version {version} has no passing verdict (tag quantpipe.verdict is "
                            f"{mv.tags.get('quantpipe.verdict')!r}); only gated versions become champion")
    before = _alias_version(client, name, "champion")
    if before == str(version):
        raise RegistryError(f"{name} version {version} is already champion")
    if before is not None:
        client.set_registered_model_alias(name, "previous", before)
    client.set_registered_model_alias(name, "champion", str(version))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    client.set_model_version_tag(name, str(version), "quantpipe.promoted_at", stamp)
    client.set_model_version_tag(name, str(version), "quantpipe.promoted_reason", reason or "promote")
    return {"name": name, "champion": int(version), "previous": int(before) if before else None}


def rollback(name: str, registry_uri: str = DEFAULT_REGISTRY, reason: str = "") -> dict:
    client = _client(registry_uri)
    current = _alias_version(client, name, "champion")
    previous = _alias_version(client, name, "previous")
    if current is None:
        raise RegistryError(f"model {name!r} has no champion to roll back")
    if previous is None:
        raise RegistryError(f"model {name!r}: champion is version {current} and there is no previous one")
    client.set_registered_model_alias(name, "champion", previous)
    client.delete_registered_model_alias(name, "previous")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    client.set_model_version_tag(name, current, "quantpipe.rolled_back_at", stamp)
    client.set_model_version_tag(name, current, "quantpipe.rolled_back_reason", reason or "rollback")
    return {"name": name, "champion": int(previous), "rolled_back": int(current)}


def source_model(uri: str, registry_uri: str | None = None) -> str:
    """The model a registered version was quantized from (models:/NAME@ALIAS or /VERSION), as
    a local path whose sha256 is the one its artifact records: the path its publisher
    recorded, else the default model. A clear error when neither is that model."""
    from quantpipe.formats.artifact import model_sha256
    from quantpipe.runtime.model.loader import resolve_model_path

    registry_uri = resolve_registry_uri(registry_uri)
    folder = resolve_model_uri(uri, registry_uri)  # checks the form and that the version exists
    src = read_manifest(folder, f"model {uri}")["source_model"]
    name, alias, version = MODEL_URI.fullmatch(uri).groups()
    client = _client(registry_uri)
    mv = _version(client, name, _alias_version(client, name, alias) if alias else version)
    places = [mv.tags.get("quantpipe.source_model_path")]
    try:
        places.append(resolve_model_path(None))
    except ValueError:
        pass
    for place in places:
        if place and os.path.exists(place) and model_sha256(place) == src["sha256"]:
            return place
    raise RegistryError(f"model {uri}: its source model ({src['path']}, sha256 {src['sha256'][:12]}) is not on "
                        f"this machine at a recorded place; pass that model as MODEL")


def resolve_model_uri(uri: str, registry_uri: str | None = None, cache: str = ".quantpipe/models") -> str:
    """models:/NAME@ALIAS or models:/NAME/VERSION -> a local artifact folder (downloaded once)."""
    import mlflow.artifacts

    registry_uri = resolve_registry_uri(registry_uri)
    m = MODEL_URI.fullmatch(uri)
    if not m:
        raise RegistryError(f"model {uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    name, alias, version = m.groups()
    client = _client(registry_uri)
    if alias:
        version = _alias_version(client, name, alias)
        if version is None:
            raise RegistryError(f"model {uri!r}: {name!r} has no alias {alias!r} in {registry_uri}")
    mv = _version(client, name, version)
    dst = Path(cache) / name / str(mv.version)
    if not (dst / "MLmodel").exists():  # downloaded once, into place only when complete
        import tempfile

        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{mv.version}.partial-", dir=dst.parent))
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{mv.version}", dst_path=str(tmp))
            os.replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    import yaml

    flavor = yaml.safe_load((dst / "MLmodel").read_text())["flavors"].get("python_function", {})
    rel = flavor.get("artifacts", {}).get("artifact", {}).get("path")
    if rel is None:
        raise RegistryError(f"model {uri!r} is not a quantpipe model (no 'artifact' in its pyfunc flavour)")
    folder = dst / rel
    want = mv.tags.get("quantpipe.artifact_sha256")
    if want and artifact_sha256(folder) != want:
        raise RegistryError(f"model {uri!r}: the downloaded artifact's sha256 is not the one registered")
    return str(folder)
