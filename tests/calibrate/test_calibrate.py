"""`quantpipe calibrate` on generated logs whose strata and planted problems are known."""

from __future__ import annotations

import json
import os

import pytest

from quantpipe.calibrate import CalibConfig, calibrate
from quantpipe.cli import main
from quantpipe.manifest import StageError
from tests.calibrate.synth import write_log


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("logs") / "requests.jsonl.gz")
    return write_log(path, n=10000)


@pytest.fixture(scope="module")
def result(synth, tmp_path_factory):
    out = tmp_path_factory.mktemp("sets") / "task"
    return calibrate(CalibConfig(logs=[synth.path], strata=["metadata.task"], out=str(out)))


def test_strata_shares_floor_and_counts(synth, result):
    m = result.manifest
    by = {s["name"]: s for s in m["strata"]}
    assert set(by) == {f"metadata.task={t}" for t in synth.shares}
    assert m["counts"]["calib"] == 512 and m["counts"]["heldout"] == 256
    small = by["metadata.task=translate"]
    assert small["calib_count"] == 16 and small["heldout_count"] >= 1  # lifted to the floor
    for name, s in by.items():
        if name != "metadata.task=translate":
            assert abs(s["calib_share"] - s["log_share"]) <= 0.02, s
    # Every planted problem is counted exactly.
    for reason, n in synth.planted.items():
        assert m["dropped"][reason] == n, (reason, m["dropped"])
    assert m["counts"]["cleaned"] == 10000  # every planted extra was dropped, nothing else
    assert m["lines_read"] == 10000 + sum(synth.planted.values())


def test_heldout_and_calibration_share_no_conversation(result):
    calib, held = result.rows("calib"), result.rows("heldout")
    assert {r["conversation"] for r in calib}.isdisjoint({r["conversation"] for r in held})
    assert {r["source_id"] for r in calib}.isdisjoint({r["source_id"] for r in held})
    for r in calib + held:
        assert r["num_tokens"] >= 16 and r["stratum"].startswith("metadata.task=")
        assert r["conversation"].startswith("id:" + r["strata"]["metadata.task"])


def test_every_planted_pii_is_scrubbed(synth, result, tmp_path):
    assert result.manifest["pii_scrubbed"] == {k: 100 for k in synth.pii}
    # Take every record, so every planted value is in the output to be checked.
    out = calibrate(CalibConfig(logs=[synth.path], strata=["metadata.task"], size=10000, heldout_size=0,
                                out=str(tmp_path / "all")))
    text = out.calib_path.read_text()
    assert out.manifest["counts"]["calib"] == 10000
    for kind, values in synth.pii.items():
        assert len(values) == 100
        for v in values:
            assert v not in text, (kind, v)
        assert text.count(f"<{kind}>") == 100, kind


def test_reruns_are_byte_identical(synth, result, tmp_path):
    # The rerun reads the log with two worker processes (`result` read it in-process): the
    # output must not depend on how the first pass was split.
    again = calibrate(CalibConfig(logs=[synth.path], strata=["metadata.task"], workers=2, out=str(tmp_path / "again")))
    for name in ("calib.jsonl", "heldout.jsonl", "manifest.json"):
        assert (result.path / name).read_bytes() == (again.path / name).read_bytes(), name
    other = calibrate(CalibConfig(logs=[synth.path], strata=["metadata.task"], seed=1, out=str(tmp_path / "s1")))
    assert other.calib_path.read_bytes() != result.calib_path.read_bytes()


def test_cross_product_strata_and_neyman(synth, tmp_path):
    out = calibrate(CalibConfig(logs=[synth.path], strata=["metadata.task", "length"], allocation="neyman",
                                length_edges=[64, 96, 128], min_per_stratum=4, out=str(tmp_path / "x")))
    names = [s["name"] for s in out.manifest["strata"]]
    assert all(n.startswith("metadata.task=") and "|length=" in n for n in names)
    assert all(s["log_count"] > 0 for s in out.manifest["strata"])  # empty cells never appear
    assert out.manifest["counts"]["calib"] == 512


def test_coverage_report_holds_the_plots(result):
    page = (result.path / "coverage.html").read_text()
    assert page.count("<svg") == 2
    for svg_id in ('id="strata-shares"', 'id="length-histogram"'):
        assert svg_id in page
    assert page.count('class="bar"') >= 3 * 4  # log, calibration, held-out bars per stratum
    assert "metadata.task=translate" in page and "&lt;EMAIL&gt;" in page


def test_cli_with_recipe_and_flag_override(synth, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"logs: [{synth.path}]\nstrata: [metadata.task]\nsize: 300\nheldout_size: 50\n")
    assert main(["calibrate", "--recipe", str(recipe), "--size", "200", "--out", str(tmp_path / "c"),
                 "--no-progress"]) == 0
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m["counts"]["calib"] == 200 and m["counts"]["heldout"] == 50
    assert m["parameters"]["size"] == 200


# -- bad input: a clear error, exit code 2, and no --out folder left behind ------------------

@pytest.mark.parametrize("args, message", [
    (["--logs", "nope.jsonl"], "nope.jsonl: no such file"),
    (["--strata", "metadata.tenant"], "no record has metadata.tenant; metadata keys found: conversation_id, task"),
    (["--size", "20000"], "size 20000 + heldout_size 256 = 20256 is larger than the"),
    (["--min-per-stratum", "200", "--strata", "metadata.task"], "min_per_stratum 200 x 4 strata = 800"),
    (["--strata", "colour"], "strata: unknown key 'colour'"),
    (["--max-bad-lines", "0.001"], "over --max-bad-lines"),
])
def test_bad_input_names_the_problem(synth, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    argv = ["calibrate", "--out", str(out), "--no-progress"] + args
    if "--logs" not in args:
        argv += ["--logs", synth.path]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]


def test_unknown_format_and_existing_out(tmp_path, capsys):
    f = tmp_path / "x.jsonl"
    f.write_text('{"foo": 1}\n')
    assert main(["calibrate", "--logs", str(f), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown format" in err and "--text-field" in err and "foo" in err
    (tmp_path / "exists").mkdir()
    with pytest.raises(StageError, match="already exists"):
        calibrate(CalibConfig(logs=[str(f)], text_field="foo", out=str(tmp_path / "exists")))
