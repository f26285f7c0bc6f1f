"""Calibration sets: the folder `quantpipe calibrate` writes and every later stage reads.

    calib.jsonl     one JSON object per line: the texts quantization calibrates on
    heldout.jsonl   the same shape: the texts the eval scores (never calibrated on)
    manifest.json   how the set was made; `outputs` records each file's sha256 and rows

A row is `{"text": str, "stratum": str, ...}` (`strata`, `num_tokens`, `source_id`,
`conversation` too, as calibrate writes them). Opening a set checks each file against the
sha256 and row count its manifest recorded, so a set edited after calibrate wrote it is
refused rather than trusted; a malformed line is an error naming the file and the line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from quantpipe.manifest import StageError, sha256_file, write_json

CALIB = "calib.jsonl"
HELDOUT = "heldout.jsonl"
MANIFEST = "manifest.json"
FILES = {"calib": CALIB, "heldout": HELDOUT}


def write(folder: str | os.PathLike, calib_rows: list[dict], heldout_rows: list[dict], manifest: dict) -> dict:
    """Write a set into `folder` (an empty staging folder); records each file's sha256 and
    row count in the manifest's `outputs`, writes the manifest and returns it."""
    folder = Path(folder)
    for rows in (calib_rows, heldout_rows):
        for i, row in enumerate(rows, 1):
            _check_row(row, f"row {i}")
    outputs = {}
    for name, rows in ((CALIB, calib_rows), (HELDOUT, heldout_rows)):
        with open(folder / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
        outputs[name] = {"sha256": sha256_file(folder / name), "rows": len(rows)}
    manifest["outputs"] = outputs
    write_json(folder / MANIFEST, manifest)
    return manifest


@dataclass
class CalibSet:
    """An opened, verified set. `sha256[name]` and `manifest_sha256` are computed once, here."""

    path: Path
    manifest: dict
    sha256: dict[str, str] = field(default_factory=dict)
    manifest_sha256: str = ""
    _rows: dict[str, list[dict]] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike, option: str = "--calib") -> CalibSet:
        """Open the set at `path`; any missing, malformed or changed file is a StageError that
        names `option`, the file and what was expected."""
        path = Path(path)
        where = f"{option} {path}"
        if not path.is_dir():
            raise StageError(f"{where}: no such folder (a calibration set is the folder `quantpipe calibrate` writes)")
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise StageError(f"{where}: not a calibration set (no {MANIFEST}); make one with `quantpipe calibrate`")
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StageError(f"{where}: {MANIFEST} is not valid JSON ({e})") from None
        outputs = manifest.get("outputs") if isinstance(manifest, dict) else None
        if not isinstance(outputs, dict) or manifest.get("stage") != "calibrate":
            raise StageError(f"{where}: {MANIFEST} is not a calibrate manifest (needs stage 'calibrate' and "
                             f"'outputs' with each file's sha256)")
        out = cls(path, manifest, manifest_sha256=sha256_file(mpath))
        for name in FILES.values():
            f = path / name
            if not f.is_file():
                raise StageError(f"{where}: not a calibration set (no {name}); make one with `quantpipe calibrate`")
            want = (outputs.get(name) or {}).get("sha256")
            got = sha256_file(f)
            if want != got:
                raise StageError(f"{where}: {name} has sha256 {got[:12]}, but {MANIFEST} records "
                                 f"{str(want)[:12]}: the file changed after calibrate wrote it")
            out.sha256[name] = got
        return out

    @property
    def calib_path(self) -> Path:
        return self.path / CALIB

    @property
    def heldout_path(self) -> Path:
        return self.path / HELDOUT

    def rows(self, which: str = "calib") -> list[dict]:
        """The rows of calib.jsonl ("calib") or heldout.jsonl ("heldout"), each validated."""
        if which not in FILES:
            raise ValueError(f"which must be one of {', '.join(FILES)}, got {which!r}")
        if which not in self._rows:
            self._rows[which] = _read_rows(self.path / FILES[which])
            recorded = (self.manifest["outputs"].get(FILES[which]) or {}).get("rows")
            if recorded is not None and recorded != len(self._rows[which]):
                raise StageError(f"{self.path / FILES[which]}: {len(self._rows[which])} rows, but {MANIFEST} "
                                 f"records {recorded}")
        return self._rows[which]

    def texts(self, which: str = "calib") -> list[str]:
        return [r["text"] for r in self.rows(which)]

    def strata(self) -> list[str]:
        """The strata names the manifest's table lists, in its order."""
        return [s["name"] for s in self.manifest.get("strata", []) if isinstance(s, dict) and "name" in s]

    def info(self, which: str) -> dict:
        """What a downstream manifest or report records about the file it read."""
        return {"path": str(self.path), "sha256": self.sha256[FILES[which]], "manifest_sha256": self.manifest_sha256}


def _check_row(row, where: str) -> None:
    if not isinstance(row, dict):
        raise StageError(f"{where}: expected a JSON object with 'text' and 'stratum', got {type(row).__name__}")
    for key in ("text", "stratum"):
        if not isinstance(row.get(key), str):
            raise StageError(f"{where}: '{key}' must be a string, got {row.get(key)!r:.40}")
    if not row["text"]:
        raise StageError(f"{where}: 'text' is empty")


def _read_rows(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise StageError(f"{path} line {n}: not valid JSON ({e.msg}, column {e.colno})") from None
                _check_row(row, f"{path} line {n}")
                rows.append(row)
        except UnicodeDecodeError as e:
            raise StageError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return rows
