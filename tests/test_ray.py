"""A real local Ray cluster: a head on 127.0.0.1 plus one worker node, each with one CPU
(so two workers), started here with `ray start` and stopped at the end.

- calibrate over 20 log files through Ray Data writes the same sets, manifest and
  coverage page, byte for byte, as the local run;
- an eval of 3 candidates, scored in held-out shards and per-model tasks on the two
  workers, gives the same report numbers as the sequential eval in this process;
- a task's error and an unreachable or version-mismatched cluster are refused by name.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from quantpipe.calibrate import CalibConfig, calibrate
from quantpipe.distributed import TaskResources, check_version, run_tasks, session
from quantpipe.eval.stage import evaluate
from quantpipe.eval.suite import EvalSuite
from quantpipe.formats.calib_set import CalibSet
from quantpipe.manifest import StageError
from quantpipe.quantize import QuantConfig, quantize

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_LOG = ROOT / "calib_sets" / "sample" / "requests.jsonl.gz"
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head` on 127.0.0.1 and one more node joined to it; its address."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", str(200 << 20), "--disable-usage-stats"]
    try:
        subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                        "--include-dashboard", "false", *common], env=env, check=True, capture_output=True,
                       timeout=120)
        subprocess.run([RAY, "start", "--address", address, "--node-ip-address", "127.0.0.1", *common], env=env,
                       check=True, capture_output=True, timeout=120)
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def _split_log(folder: Path, parts: int = 20) -> list[str]:
    """The shipped sample log dealt into `parts` files, plain, .gz and .zst in turn."""
    with gzip.open(SAMPLE_LOG, "rt", encoding="utf-8") as f:
        lines = f.readlines()
    folder.mkdir()
    names = []
    for k in range(parts):
        data = "".join(lines[k::parts]).encode()
        name = folder / f"part-{k:02d}.jsonl"
        if k % 3 == 1:
            name = name.with_suffix(".jsonl.gz")
            name.write_bytes(gzip.compress(data, mtime=0))
        elif k % 3 == 2:
            name = name.with_suffix(".jsonl.zst")
            name.write_bytes(zstandard.ZstdCompressor().compress(data))
        else:
            name.write_bytes(data)
        names.append(str(name))
    return names


def _calib_config(logs: list[str], out: Path, **kw) -> CalibConfig:
    return CalibConfig(logs=logs, out=str(out), strata=["metadata.task", "length"], length_edges=[128, 256, 512],
                       size=256, heldout_size=96, min_per_stratum=4, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_calibrate_over_20_files_through_ray_data_is_byte_identical(ray_cluster, tmp_path):
    logs = _split_log(tmp_path / "logs")
    local = calibrate(_calib_config(logs, tmp_path / "local"))
    on_ray = calibrate(_calib_config(logs, tmp_path / "ray", ray=ray_cluster))
    assert local.manifest["counts"]["calib"] == 256 and len(local.manifest["inputs"]) == 20
    assert _files(Path(on_ray.path)) == _files(Path(local.path))
    assert "ray" not in json.loads((Path(on_ray.path) / "manifest.json").read_text())["parameters"]


def test_logs_by_filesystem_uri_give_the_same_sets(tmp_path):
    """file:// URIs go through pyarrow's filesystem layer, as s3:// and gs:// paths do."""
    logs = _split_log(tmp_path / "logs", parts=4)
    local = calibrate(_calib_config(logs, tmp_path / "local"))
    uris = calibrate(_calib_config([f"file://{tmp_path}/logs/part-*"], tmp_path / "uri"))
    for name in ("calib.jsonl", "heldout.jsonl"):
        assert (Path(uris.path) / name).read_bytes() == (Path(local.path) / name).read_bytes()
    assert ([i["sha256"] for i in uris.manifest["inputs"]] == [i["sha256"] for i in local.manifest["inputs"]])
    with pytest.raises(StageError, match=r"--logs file://.*/nothing-\*: no file matches"):
        calibrate(_calib_config([f"file://{tmp_path}/logs/nothing-*"], tmp_path / "none"))


def _strip(report: dict) -> dict:
    """The numbers: what ran where and how long it took left out."""
    return {k: v for k, v in report.items() if k not in ("time_s", "ray")}


def test_eval_of_3_candidates_on_2_workers_matches_the_sequential_eval(ray_cluster, sample_set, w8a16_artifact,
                                                                       tmp_path):
    candidates = [w8a16_artifact]
    for name, cfg in (("w4g64", QuantConfig(scheme="W4A16", group_size=64)),
                      ("w4g32", QuantConfig(scheme="W4A16", group_size=32))):
        candidates.append(str(quantize(None, cfg, None, str(tmp_path / name)).path))
    (tmp_path / "suite.yaml").write_text(
        "quality: {max_texts: 12, max_tokens: 64, bootstrap: 100, seed: 0}\n"
        "generation: {prompts: 2, max_tokens: 4}\n"
        "mc: {tasks: [general_knowledge], limit: 4}\n")
    suite = EvalSuite.load(str(tmp_path / "suite.yaml"))
    seq = evaluate(candidates, sample_set, str(tmp_path / "seq"), suite=suite, scope="quality")
    dist = evaluate(candidates, sample_set, str(tmp_path / "ray"), suite=suite, scope="quality", ray=ray_cluster)
    assert dist["ray"]["shards"] == 2 and dist["ray"]["cluster_cpus"] == 2
    assert dist["ray"]["scoring_task"]["memory"] > 0
    assert [c["name"] for c in seq["candidates"]] == ["w8a16", "w4g64", "w4g32"]
    assert all({"quality", "generation", "mc"} <= set(c) for c in seq["candidates"])
    assert _strip(dist) == _strip(seq)
    on_disk = json.loads((tmp_path / "ray" / "report.json").read_text())
    assert _strip(on_disk) == _strip(json.loads((tmp_path / "seq" / "report.json").read_text()))


def test_a_task_error_reaches_the_driver_by_name_and_versions_must_match(ray_cluster):
    with session(ray_cluster) as ray:
        with pytest.raises(StageError, match=r"^--calib /nowhere: no such folder"):
            run_tasks(ray, CalibSet.open, [("/nowhere",)], TaskResources())
        with pytest.raises(StageError, match="Ray task len failed: TypeError"):
            run_tasks(ray, len, [(3,)], TaskResources())
    with pytest.raises(StageError, match=r"a Ray worker runs quantpipe 0\.0\.0-other, this process .*same version"):
        check_version(("0.0.0-other", None))


def test_an_unreachable_cluster_is_refused_in_seconds(tmp_path):
    port = _free_port()  # nothing listens there
    with pytest.raises(StageError, match=rf"--ray 127\.0\.0\.1:{port}: no Ray cluster answers there"):
        calibrate(_calib_config([str(SAMPLE_LOG)], tmp_path / "out", ray=f"127.0.0.1:{port}"))
    assert not (tmp_path / "out").exists()


def test_pipeline_quantizes_candidates_in_parallel_with_the_same_bytes(ray_cluster, sample_set, tmp_path,
                                                                         monkeypatch):
    """A plain candidate as one task and two mixed-precision rungs chained in another (the
    second reuses the first's sensitivities, as in the local order): the same files."""
    from quantpipe.distributed import TaskResources
    from quantpipe.formats.artifact import model_sha256
    from quantpipe.pipeline.recipe import PipelineRecipe
    from quantpipe.pipeline.run import Run, quantize_all
    from quantpipe.runtime.model.loader import resolve_model_path

    probe = {"scheme": "mixed", "method": "rtn", "sensitivity_samples": 1, "sensitivity_tokens": 16}
    recipe = PipelineRecipe.from_dict({"name": "smol", "calibrate": {"set": sample_set}, "candidates": [
        {"scheme": "W4A16", "group_size": 64, "method": "rtn"}, dict(probe, bits_budget=5.0),
        dict(probe, bits_budget=6.0)]})
    out = {}
    for where in ("local", "ray"):
        (tmp_path / where).mkdir()
        monkeypatch.chdir(tmp_path / where)  # artifacts/ is relative: Ray's tasks run in the driver's folder
        run = Run(recipe, None, "policy.yaml", ray=ray_cluster if where == "ray" else None, resources=TaskResources())
        run.src = resolve_model_path(None)
        run.src_sha, run.calib = model_sha256(run.src), sample_set
        out[where] = {name: _files(tmp_path / where / path) for name, path in quantize_all(run, recipe.candidates).items()}
        assert set(run.keys.keys) == {f"quantize:{c.name}" for c in recipe.candidates}
    assert len(out["local"]) == 3
    for name, files in out["local"].items():
        manifests = [json.loads(out[w][name].pop("quantpipe.json")) for w in ("local", "ray")]
        assert out["ray"][name] == files  # weights, config, tokenizer: every byte
        assert _untimed(manifests[1]) == _untimed(manifests[0])
    six = json.loads((tmp_path / "ray" / "artifacts" / "smol" / recipe.candidates[2].name / "quantpipe.json").read_text())
    assert six["mixed_precision"]["reused_from"]["artifact"] == recipe.candidates[1].name


def _untimed(doc: dict) -> dict:
    """A manifest without what records the run itself: its timings and peak memory."""
    return {k: v for k, v in doc.items() if k not in ("time_s", "peak_rss_mib")}
