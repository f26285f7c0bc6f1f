"""On a real local Ray cluster started here (a head on 127.0.0.1 plus one more node, one
CPU each, so two workers) and stopped at the module's end:

- calibrate over 20 log files through Ray Data writes the same sets, manifest and
  coverage page, byte for byte, as the local run, and so does a log of Parquet and CSV
  tables;
- an eval of 3 candidates, scored in held-out shards on the two workers (each model's
  generations and task items in one of the shards), gives the same report numbers as the
  sequential eval in this process;
- a task's error and an unreachable or version-mismatched cluster are refused by name, and
  failing tasks never abort the driver;
- the pipeline quantizes its candidates as parallel tasks with the same artifact bytes.
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
from tests.calibrate.test_tables import files_of, table_config, write_tables
from tests.test_pipeline import RUNGS, quantize_step

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_LOG = ROOT / "calib_sets" / "sample" / "requests.jsonl.gz"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster: `ray start --head` on 127.0.0.1 and one more node joined to
    it, one CPU each (two workers); its address. Stopped (`ray stop`) when this module ends:
    Ray's daemons would otherwise take CPU from the rest of the session."""
    ray = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", str(200 << 20), "--disable-usage-stats"]
    try:
        subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                        "--include-dashboard", "false", *common], env=env, check=True, capture_output=True,
                       timeout=120)
        subprocess.run([ray, "start", "--address", address, "--node-ip-address", "127.0.0.1", *common], env=env,
                       check=True, capture_output=True, timeout=120)
        yield address
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)



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


def test_calibrate_over_20_files_through_ray_data_is_byte_identical(ray_cluster, tmp_path):
    logs = _split_log(tmp_path / "logs")
    local = calibrate(_calib_config(logs, tmp_path / "local"))
    on_ray = calibrate(_calib_config(logs, tmp_path / "ray", ray=ray_cluster))
    assert local.manifest["counts"]["calib"] == 256 and len(local.manifest["inputs"]) == 20
    assert files_of(Path(on_ray.path)) == files_of(Path(local.path))
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


def test_parquet_and_csv_logs_through_ray_data_are_byte_identical(ray_cluster, tmp_path):
    """Tables go through the same read tasks and featurizing actors, as blocks of rows; Parquet
    files by file:// URI (pyarrow's filesystem layer, as for s3://) give the same sets."""
    logs = write_tables(tmp_path / "logs")
    local = calibrate(table_config(logs, tmp_path / "local"))
    on_ray = calibrate(table_config(logs, tmp_path / "ray", ray=ray_cluster))
    assert files_of(Path(on_ray.path)) == files_of(Path(local.path))
    assert local.manifest["lines_read"] == 2500 and len(local.manifest["malformed_lines"]) == 2
    uris = calibrate(table_config([f"file://{p}" for p in logs[:3]] + logs[3:], tmp_path / "uri", ray=ray_cluster))
    for name in ("calib.jsonl", "heldout.jsonl"):
        assert (Path(uris.path) / name).read_bytes() == (Path(local.path) / name).read_bytes()


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
        "quality: {max_texts: 8, max_tokens: 64, bootstrap: 100, seed: 0}\n"
        "generation: {prompts: 2, max_tokens: 4}\n"
        "mc: {tasks: [general_knowledge], limit: 2}\n")
    suite = EvalSuite.load(str(tmp_path / "suite.yaml"))
    seq = evaluate(candidates, sample_set, str(tmp_path / "seq"), suite=suite, scope="quality")
    dist = evaluate(candidates, sample_set, str(tmp_path / "ray"), suite=suite, scope="quality", ray=ray_cluster)
    assert dist["ray"]["shards"] == 2 and dist["ray"]["cluster_cpus"] == 2
    assert dist["ray"]["task"]["memory"] > 0
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


DRIVER_OF_FAILING_TASKS = """
import sys
from quantpipe.distributed import TaskResources, run_tasks, session
from quantpipe.manifest import StageError
refused = 0
with session(sys.argv[1]) as ray:
    for _ in range(int(sys.argv[2])):
        try:
            run_tasks(ray, len, [(3,), ([1],), (4,)], TaskResources())
        except StageError:
            refused += 1
print(refused, "refused")
"""


def test_failing_tasks_never_abort_the_driver(ray_cluster):
    """A driver that cancels a task whose failure it is still processing is aborted by Ray
    2.60 (exit 1, an internal check); run_tasks cancels only what has not finished. Failing
    runs in a driver of its own, which must live to the end (before the fix it died within
    seconds)."""
    rounds = 25
    env = {**os.environ, "RAY_IGNORE_UNHANDLED_ERRORS": "1"}
    done = subprocess.run([sys.executable, "-c", DRIVER_OF_FAILING_TASKS, ray_cluster, str(rounds)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(rounds), "refused"]


def test_a_latency_ab_asking_for_a_gpu_is_refused_on_a_cluster_without_one(ray_cluster, sample_set, w8a16_artifact,
                                                                           tmp_path):
    with pytest.raises(StageError, match=r"--ray-gpus 1: no node of the cluster has that many GPUs"):
        evaluate([w8a16_artifact], sample_set, str(tmp_path / "lat"), scope="latency", ray=ray_cluster,
                 resources=TaskResources(num_gpus=1))
    assert not (tmp_path / "lat").exists()


def test_an_unreachable_cluster_is_refused_in_seconds(tmp_path):
    port = _free_port()  # nothing listens there
    with pytest.raises(StageError, match=rf"--ray 127\.0\.0\.1:{port}: no Ray cluster answers there"):
        calibrate(_calib_config([str(SAMPLE_LOG)], tmp_path / "out", ray=f"127.0.0.1:{port}"))
    assert not (tmp_path / "out").exists()


def test_pipeline_quantizes_candidates_in_parallel_with_the_same_bytes(quantized_rungs, ray_cluster, sample_set,
                                                                         tmp_path):
    """The pipeline's quantize step: the plain candidate as one task and the two
    mixed rungs chained in another (the 6-bit one reusing the 5-bit table, as in the local
    order) write the files the local run wrote, byte for byte, and record the same keys."""
    recipe, run, artifacts, printed = quantize_step(tmp_path / "ray", sample_set, RUNGS, ray=ray_cluster)
    assert "3 candidate(s) as 2 Ray task(s)" in printed
    assert set(run.keys.keys) == {f"quantize:{c.name}" for c in recipe.candidates}
    local = quantized_rungs[2]
    for name, path in artifacts.items():
        files, want = files_of(path), files_of(local[name])
        manifests = [json.loads(f.pop("quantpipe.json")) for f in (files, want)]
        assert files == want  # weights, config, tokenizer
        # The manifests too, but for what records the run itself.
        assert [{k: v for k, v in m.items() if k not in ("time_s", "peak_rss_mib")} for m in manifests][0] == \
            {k: v for k, v in manifests[1].items() if k not in ("time_s", "peak_rss_mib")}
    assert json.loads((artifacts[recipe.candidates[2].name] / "quantpipe.json").read_text())[
        "mixed_precision"]["reused_from"]["artifact"] == recipe.candidates[1].name
