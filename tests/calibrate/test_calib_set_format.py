"""The calibration-set format (quantpipe.formats.calib_set): every stage that reads a set
refuses a changed or malformed one with one line naming the file, and writes nothing."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from quantpipe.cli import main
from quantpipe.formats.calib_set import CalibSet
from quantpipe.manifest import StageError


@pytest.fixture
def a_set(sample_set, tmp_path) -> Path:
    dst = tmp_path / "set"
    shutil.copytree(sample_set, dst)
    return dst


def _edit(folder: Path, name: str, edit, rehash: bool) -> None:
    """Change `name`'s lines; with `rehash`, record the new sha256 in the manifest too (a set
    that a faulty writer produced, rather than one edited after the fact)."""
    path = folder / name
    lines = path.read_text(encoding="utf-8").splitlines()
    path.write_text("\n".join(edit(lines)) + "\n", encoding="utf-8")
    if rehash:
        m = json.loads((folder / "manifest.json").read_text())
        m["outputs"][name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (folder / "manifest.json").write_text(json.dumps(m))


def test_a_set_opens_with_its_hashes_computed_once_and_rows_validated(sample_set):
    cs = CalibSet.open(sample_set)
    m = cs.manifest["outputs"]
    assert cs.sha256 == {name: m[name]["sha256"] for name in ("calib.jsonl", "heldout.jsonl")}
    assert len(cs.rows("heldout")) == m["heldout.jsonl"]["rows"] and len(cs.texts()) == m["calib.jsonl"]["rows"]
    assert cs.info("heldout")["sha256"] == m["heldout.jsonl"]["sha256"]
    assert cs.strata() and all(isinstance(s, str) for s in cs.strata())


def test_a_file_changed_after_calibrate_is_refused(a_set):
    _edit(a_set, "heldout.jsonl", lambda ls: ls[:-1], rehash=False)
    with pytest.raises(StageError, match=r"heldout.jsonl has sha256 \w+, but manifest.json records \w+: the file "
                                         r"changed after calibrate wrote it"):
        CalibSet.open(a_set)


@pytest.mark.parametrize("edit, message", [
    (lambda ls: ls[:3] + [ls[3][:25]] + ls[4:], r"heldout.jsonl line 4: not valid JSON"),
    (lambda ls: ls[:1] + ['["a list"]'] + ls[2:], r"heldout.jsonl line 2: expected a JSON object"),
    (lambda ls: ls + ['{"stratum": "x"}'], r"heldout.jsonl line \d+: 'text' must be a string"),
    (lambda ls: ls + ['{"text": "", "stratum": "x"}'], r"heldout.jsonl line \d+: 'text' is empty"),
], ids=["torn-line", "not-an-object", "no-text", "empty-text"])
def test_a_malformed_line_names_the_file_and_line(a_set, edit, message):
    _edit(a_set, "heldout.jsonl", edit, rehash=True)
    with pytest.raises(StageError, match=message):
        CalibSet.open(a_set).rows("heldout")


def test_rows_must_match_the_manifests_count(a_set):
    _edit(a_set, "calib.jsonl", lambda ls: ls[:-1], rehash=True)
    with pytest.raises(StageError, match=r"calib.jsonl: \d+ rows, but manifest.json records \d+"):
        CalibSet.open(a_set).rows("calib")


def test_a_corrupt_or_missing_manifest_is_refused(a_set, tmp_path):
    (a_set / "manifest.json").write_text("{\"stage\": ")
    with pytest.raises(StageError, match="--calib .*: manifest.json is not valid JSON"):
        CalibSet.open(a_set)
    (a_set / "manifest.json").write_text(json.dumps({"stage": "quantize"}))
    with pytest.raises(StageError, match="manifest.json is not a calibrate manifest"):
        CalibSet.open(a_set)
    (a_set / "manifest.json").unlink()
    with pytest.raises(StageError, match=r"not a calibration set \(no manifest.json\)"):
        CalibSet.open(a_set)
    with pytest.raises(StageError, match="calibrate.set .*: no such folder"):
        CalibSet.open(tmp_path / "nowhere", "calibrate.set")


def test_eval_and_quantize_refuse_a_bad_set_in_one_line_and_write_nothing(a_set, w8a16_artifact, tmp_path, capsys):
    _edit(a_set, "heldout.jsonl", lambda ls: ls[:2] + ["{not json"] + ls[3:], rehash=True)
    out = tmp_path / "report"
    assert main(["eval", "--candidate", w8a16_artifact, "--calib", str(a_set), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("heldout.jsonl line 3: not valid JSON (Expecting property name enclosed in double quotes, "
                        "column 2)") and "\n" not in err and "Traceback" not in err
    assert not out.exists()
    _edit(a_set, "calib.jsonl", lambda ls: ls + ["oops"], rehash=False)
    art = tmp_path / "artifact"
    assert main(["quantize", "--scheme", "W8A16", "--method", "gptq", "--calib", str(a_set), "--out", str(art)]) == 2
    err = capsys.readouterr().err.strip()
    assert "calib.jsonl has sha256" in err and "\n" not in err
    assert not art.exists() and not list(tmp_path.glob("artifact*"))
