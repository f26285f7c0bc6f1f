"""Publish, promote, roll back and serve through a real `mlflow server` (sqlite store) on
127.0.0.1, read back with the official MLflow client.

Reports here are written by hand and judged by the real gate (the eval has its own tests):
what matters is that only a passing, current, full verdict under the project's policy,
whose report is unchanged and judges the same again, gets a version.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from quantpipe.formats.artifact import artifact_sha256
from quantpipe.gate import DEFAULT_POLICY, gate
from quantpipe.manifest import StageError, sha256_file
from quantpipe.registry import RegistryError, promote, publish, resolve_model_uri, rollback

mlflow = pytest.importorskip("mlflow")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, folder: Path, port: int | None = None):
        self.folder, self.port = folder, port or _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> MlflowServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = open(self.folder / "server.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--artifacts-destination", str(self.folder / "artifacts"), "--workers", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-3000:]
            try:
                if httpx.get(self.uri + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("mlflow server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # gunicorn and its workers
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def artifact(w8a16_artifact):
    return w8a16_artifact


def _ci(point: float, lower: float, upper: float) -> dict:
    return {"point": point, "ci_lower": lower, "ci_upper": upper}


def verdict_for(artifact: str, folder: Path, verdict: str = "pass", scope: str = "full",
                policy: Path = DEFAULT_POLICY) -> str:
    """A report with every metric the default policy names (values a W8A16 artifact shows)
    and the real gate's verdict on it, as `quantpipe eval` and `quantpipe gate` leave them.
    verdict="fail": the same with a KL past the policy's bound."""
    folder.mkdir(parents=True, exist_ok=True)
    kl = _ci(0.004, 0.003, 0.005) if verdict == "pass" else _ci(0.4, 0.3, 0.5)
    stratum = {"texts": 40, "kl_mean": {"point": 0.005, "ci_lower": 0.004, "ci_upper": 0.006},
               "ppl_delta_pct": _ci(0.1, -0.2, 0.4)}
    entry = {"name": Path(artifact).name, "sha256": artifact_sha256(artifact), "path": artifact,
             "quality": {"kl_mean": kl, "ppl_delta_pct": _ci(0.05, -0.1, 0.2), "top1_agreement": _ci(0.98, 0.97, 0.99),
                         "strata": {"metadata.task=code_complete": stratum}},
             "mc": {"accuracy_drop_points": {"point": 0.0, "ci_upper": 1.0, "stderr": 0.5},
                    "flips_pct": _ci(1.5, 0.4, 3.3)},
             "memory": {"weight_bytes_ratio": 0.5}}
    if scope == "full":
        entry["latency"] = {"tpot_p50_ratio": _ci(0.95, 0.9, 1.0), "ttft_p99_ratio": _ci(1.0, 0.9, 1.1),
                            "error_rate": 0.0}
    report = {"stage": "eval", "scope": scope, "heldout": {"path": str(folder), "sha256": "0" * 64},
              "candidates": [entry]}
    (folder / "report.json").write_text(json.dumps(report))
    (folder / "report.html").write_text("<html></html>")
    gate(str(folder), str(policy), artifact=artifact, out=str(folder / "verdict.json"))
    assert json.loads((folder / "verdict.json").read_text())["verdict"] == verdict
    return str(folder / "verdict.json")


def _client(server):
    return mlflow.tracking.MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)


def test_publish_promote_serve_and_roll_back(server, artifact, tmp_path):
    client = _client(server)
    first = publish(artifact, verdict_for(artifact, tmp_path / "r1"), "smol", server.uri)
    assert first["version"] == 1 and first["uri"] == "models:/smol/1"
    mv = client.get_model_version_by_alias("smol", "candidate")
    assert mv.version == "1" and mv.tags["quantpipe.verdict"] == "pass"
    assert mv.tags["quantpipe.artifact_sha256"] == artifact_sha256(artifact)
    run = client.get_run(first["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["scheme"] == "W8A16" and run.data.params["policy_sha256"] == sha256_file(DEFAULT_POLICY)
    assert run.data.metrics["quality.kl_mean"] == 0.004 and run.data.metrics["quality.kl_mean.ci_upper"] == 0.005
    assert "quality.strata.metadata.task_code_complete.kl_mean" in run.data.metrics
    assert {a.path for a in client.list_artifacts(first["run_id"], "eval")} >= {"eval/report.json", "eval/verdict.json"}

    # pyfunc: the registered model generates text with the quantpipe runtime
    os.environ["MLFLOW_TRACKING_URI"] = server.uri
    try:
        model = mlflow.pyfunc.load_model("models:/smol@candidate")
        out = model.predict(["The capital of France is"], params={"max_tokens": 6})
        assert len(out) == 1 and isinstance(out[0], str) and out[0].strip()
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]

    assert promote("smol", 1, server.uri)["champion"] == 1
    second = publish(artifact, verdict_for(artifact, tmp_path / "r2"), "smol", server.uri)
    assert second["version"] == 2 and client.get_model_version_by_alias("smol", "candidate").version == "2"
    assert promote("smol", 2, server.uri, reason="canary passed") == {"name": "smol", "champion": 2, "previous": 1}

    # serve the champion straight from the registry
    port = _free_port()
    env = dict(os.environ, MLFLOW_TRACKING_URI=server.uri)
    proc = subprocess.Popen([sys.executable, "-m", "quantpipe", "serve", "models:/smol@champion", "--host",
                             "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert (tmp_path / ".quantpipe" / "models" / "smol" / "2" / "MLmodel").exists()  # downloaded once, cached

    back = rollback("smol", server.uri, reason="live TPOT regressed")
    assert back == {"name": "smol", "champion": 1, "rolled_back": 2}
    assert client.get_model_version_by_alias("smol", "champion").version == "1"
    assert client.get_model_version("smol", "2").tags["quantpipe.rolled_back_reason"] == "live TPOT regressed"
    with pytest.raises(RegistryError, match="no previous one"):
        rollback("smol", server.uri)


def test_refusals_leave_no_version(server, artifact, tmp_path):
    client = _client(server)
    cases = {
        "failed": (verdict_for(artifact, tmp_path / "f", verdict="fail"), "not pass"),
        "partial": (verdict_for(artifact, tmp_path / "q", scope="quality"), "needs a full eval"),
    }
    other_policy = tmp_path / "lenient.yaml"
    other_policy.write_text("rules:\n- {metric: memory.weight_bytes_ratio, op: '<=', threshold: 1}\n")
    cases["foreign policy"] = (verdict_for(artifact, tmp_path / "p", policy=other_policy), "not the configured")
    stale = tmp_path / "stale"
    shutil.copytree(artifact, stale)
    cases["stale"] = (verdict_for(str(stale), tmp_path / "s"), "changed after its eval")
    # A verdict file edited to say pass, for a report that fails the policy.
    forged = verdict_for(artifact, tmp_path / "forged", verdict="fail")
    doc = json.loads(Path(forged).read_text())
    doc.update(verdict="pass", passed=True, rules=[{**r, "result": "pass"} for r in doc["rules"]])
    Path(forged).write_text(json.dumps(doc))
    cases["forged verdict"] = (forged, "judged again with .* gives fail for quality.kl_mean")
    # A report edited after its verdict (here, to hide a failing KL the verdict never saw).
    edited = verdict_for(artifact, tmp_path / "edited")
    report = json.loads((tmp_path / "edited" / "report.json").read_text())
    report["candidates"][0]["quality"]["kl_mean"]["ci_upper"] = 0.0051
    (tmp_path / "edited" / "report.json").write_text(json.dumps(report))
    cases["edited report"] = (edited, "the report changed after its verdict")
    # A verdict whose rules are not what the policy gives (one dropped by hand).
    partial_rules = verdict_for(artifact, tmp_path / "dropped")
    doc = json.loads(Path(partial_rules).read_text())
    doc["rules"] = doc["rules"][1:]
    Path(partial_rules).write_text(json.dumps(doc))
    cases["dropped rule"] = (partial_rules, "its rules are not what")
    for why, (verdict, message) in cases.items():
        target = str(stale) if why == "stale" else artifact
        if why == "stale":
            (stale / "config.json").write_text((stale / "config.json").read_text() + " ")
        with pytest.raises(StageError, match=message):
            publish(target, verdict, "refused", server.uri)
    assert not client.search_model_versions("name='refused'")
    # a quality-only verdict goes in only when asked, and says so
    r = publish(artifact, cases["partial"][0], "partial", server.uri, allow_partial=True)
    assert client.get_model_version("partial", str(r["version"])).tags["quantpipe.partial"] == "true"
    with pytest.raises(RegistryError, match="no version 7"):
        promote("partial", 7, server.uri)
    first = client.get_model_version("partial", "1")
    bare = client.create_model_version("partial", source=first.source,  # by hand: no verdict tags
                                       model_id=first.source.removeprefix("models:/"))
    with pytest.raises(RegistryError, match="no passing verdict"):
        promote("partial", bare.version, server.uri)
    with pytest.raises(RegistryError, match="has no alias 'champion'"):
        resolve_model_uri("models:/partial@champion", server.uri)


def test_concurrent_publishes_get_distinct_consistent_versions(server, artifact, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-m", "quantpipe", "publish", artifact, "--verdict",
                               verdict_for(artifact, tmp_path / f"c{i}"), "--name", "racing",
                               "--registry-uri", server.uri], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for i in range(2)]
    outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    client = _client(server)
    versions = sorted(int(v.version) for v in client.search_model_versions("name='racing'"))
    assert versions == [1, 2]
    for v in versions:
        mv = client.get_model_version("racing", str(v))
        assert mv.tags["quantpipe.verdict"] == "pass" and client.get_run(mv.run_id).info.status == "FINISHED"
    assert client.get_model_version_by_alias("racing", "candidate").version in ("1", "2")


def test_registry_stopped_mid_publish_leaves_no_version(artifact, tmp_path, monkeypatch):
    server = MlflowServer(tmp_path / "mlflow").start()
    from mlflow.tracking import MlflowClient

    real = MlflowClient.log_artifact

    def dies_midway(self, *a, **kw):  # the registry goes away while the eval files upload
        server.stop()
        return real(self, *a, **kw)

    monkeypatch.setattr(MlflowClient, "log_artifact", dies_midway)
    with pytest.raises(RegistryError, match="nothing registered"):
        publish(artifact, verdict_for(artifact, tmp_path / "r"), "interrupted", server.uri)
    monkeypatch.undo()
    again = MlflowServer(tmp_path / "mlflow", server.port).start()
    try:
        assert not _client(again).search_model_versions("name='interrupted'")
    finally:
        again.stop()


def test_bad_verdict_files_and_an_unreachable_registry_are_named(artifact, tmp_path, capsys, monkeypatch):
    """Each is refused with one line naming the file or the registry, before anything is
    registered; an unreachable registry says so (not "has no version")."""
    from quantpipe.cli import main

    closed = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    good = verdict_for(artifact, tmp_path / "good")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"verdict": "pass", ')
    regression = tmp_path / "regression.json"
    regression.write_text(json.dumps({"verdict": "pass", "passed": True, "kind": "regression", "rules": []}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"verdict": "pass", "rules": []}))
    # the verdict's report made unreadable, with the verdict's hash of it updated to match
    bad_report = verdict_for(artifact, tmp_path / "bad-report")
    (tmp_path / "bad-report" / "report.json").write_text("{\"stage\": \"eval\", ")
    doc = json.loads(Path(bad_report).read_text())
    doc["report"]["sha256"] = sha256_file(tmp_path / "bad-report" / "report.json")
    Path(bad_report).write_text(json.dumps(doc))
    cases = {str(corrupt): "not valid JSON", str(regression): "a regression verdict",
             str(other): r"not a gate verdict \(missing or malformed: candidate, report, policy\)",
             bad_report: "its report .*report.json: not valid JSON"}
    for verdict, message in cases.items():
        with pytest.raises(StageError, match=message):
            publish(artifact, verdict, "refused", closed)
    for call in (lambda: publish(artifact, good, "smol", closed), lambda: promote("smol", 1, closed),
                 lambda: rollback("smol", closed), lambda: resolve_model_uri("models:/smol@champion", closed)):
        with pytest.raises(RegistryError, match=rf"registry {closed}: unreachable"):
            call()
    assert main(["promote", "smol", "--version", "1", "--registry-uri", closed]) == 2
    err = capsys.readouterr().err.strip()
    assert "unreachable" in err and "\n" not in err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed)
    assert main(["serve", "models:/smol@champion"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("quantpipe serve: registry") and "unreachable" in err and "\n" not in err
