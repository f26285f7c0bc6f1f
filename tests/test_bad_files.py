"""Corrupt or foreign files handed to a stage: one line naming the file, exit 2, nothing written."""

import json
import shutil

import pytest

from quantpipe.cli import main


@pytest.mark.parametrize("content, message", [
    ("{", "quantpipe.json is not valid JSON"),
    (json.dumps({"stage": "calibrate"}), "quantpipe.json is not a quantize manifest"),
    (json.dumps({"stage": "quantize"}), "quantpipe.json has no source_model.sha256"),
], ids=["torn", "foreign", "no-source"])
def test_a_corrupt_artifact_manifest_is_named(w8a16_artifact, sample_set, tmp_path, capsys, content, message):
    art = tmp_path / "w8"
    shutil.copytree(w8a16_artifact, art)
    (art / "quantpipe.json").write_text(content)
    out = tmp_path / "report"
    assert main(["eval", "--candidate", str(art), "--calib", sample_set, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(art) in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("content, message", [
    ('{"stage": "eval", ', "report.json: not valid JSON"),
    ("[1, 2]", "not an eval report"),
    (json.dumps({"stage": "eval", "candidates": [{"name": "x"}]}), "candidates[0] has no name and sha256"),
], ids=["torn", "a-list", "no-sha"])
def test_a_corrupt_report_is_named_by_gate(tmp_path, capsys, content, message):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text(content)
    assert main(["gate", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["report.json"]  # no verdict written
    assert main(["gate", str(tmp_path / "r"), "--against", "evals/baselines/ci.yaml"]) == 2
    assert message in capsys.readouterr().err
