"""CSV and Parquet logs (generic tables with `--text-field`): read in blocks of rows, in this
process or by the featurizing workers, with the same sets either way; rows without the text
are counted as malformed by file and row; a table without `--text-field` is refused."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quantpipe.calibrate import CalibConfig, calibrate
from quantpipe.manifest import StageError

SAMPLE_LOG = Path(__file__).resolve().parents[2] / "calib_sets" / "sample" / "requests.jsonl.gz"


def write_tables(folder: Path) -> list[str]:
    """The shipped sample log's prompts as a table (id, text, task, and a nested column), dealt
    into three Parquet files (row groups of 256, so blocks cross them) and one CSV file. Two
    rows have no text."""
    rows = []
    with gzip.open(SAMPLE_LOG, "rt", encoding="utf-8") as f:
        for line in f:
            o = json.loads(line)
            req = o["request"]
            text = "\n".join(m["content"] for m in req["messages"]) if "messages" in req else req["prompt"]
            rows.append({"id": o["id"], "text": text, "task": req["metadata"]["task"],
                         "extra": {"tenant": req["metadata"].get("tenant"), "n": len(rows)}})
    rows[5]["text"] = None
    rows[2300]["text"] = None
    folder.mkdir()
    names = []
    for k, (a, b) in enumerate(((0, 800), (800, 1600), (1600, 2200))):
        path = folder / f"part-{k}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[a:b]), path, row_group_size=256)
        names.append(str(path))
    path = folder / "part-3.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, ["id", "text", "task"])
        w.writeheader()
        for r in rows[2200:]:
            w.writerow({k: r[k] for k in ("id", "text", "task")})
    names.append(str(path))
    return names


def table_config(logs: list[str], out: Path, **kw) -> CalibConfig:
    return CalibConfig(logs=logs, out=str(out), text_field="text", label_field="task", strata=["label", "length"],
                       length_edges=[128, 256], size=192, heldout_size=64, min_per_stratum=4, **kw)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_tables_read_by_worker_processes_give_the_same_sets(tmp_path):
    logs = write_tables(tmp_path / "logs")
    here = calibrate(table_config(logs, tmp_path / "here", workers=1))
    pooled = calibrate(table_config(logs, tmp_path / "pooled", workers=2))
    assert files_of(Path(pooled.path)) == files_of(Path(here.path))
    m = here.manifest
    assert m["counts"]["calib"] == 192 and m["counts"]["heldout"] == 64 and m["lines_read"] == 2500
    assert {s["name"].split("|")[0] for s in m["strata"]} >= {"label=multiple_choice", "label=code_complete"}, m["strata"]
    bad = [(Path(b["file"]).name, b["line"]) for b in m["malformed_lines"]]
    assert bad == [("part-0.parquet", 6), ("part-3.csv", 101)], m["malformed_lines"]
    assert all("no string field 'text'" in b["reason"] for b in m["malformed_lines"])


def test_a_table_without_a_text_field_is_refused_by_name(tmp_path):
    logs = write_tables(tmp_path / "logs")
    with pytest.raises(StageError, match=r"--logs .*part-0.parquet: a parquet file is a generic table and needs "
                                         r"--text-field"):
        calibrate(CalibConfig(logs=logs, out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()
    broken = tmp_path / "logs" / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(StageError, match=r"--logs .*broken.parquet: cannot be read as parquet"):
        calibrate(table_config([str(broken)], tmp_path / "out"))
    assert not (tmp_path / "out").exists()
