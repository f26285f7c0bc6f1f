"""Trace readers: Azure LLM inference trace CSV and Mooncake JSONL.

Azure (2023/2024): header TIMESTAMP,ContextTokens,GeneratedTokens with timestamps like
"2023-11-16 18:15:46.6805900". Mooncake: one JSON object per line with timestamp (ms),
input_length, output_length. Both become (arrival_s from first row, prompt, output).
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

import numpy as np


def _parse_azure_ts(s: str) -> float:
    s = s.strip()
    if s.replace(".", "", 1).isdigit():
        return float(s)
    # Python parses at most 6 fractional digits; the Azure trace has 7.
    if "." in s:
        head, frac = s.split(".", 1)
        s = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(s).timestamp()


def read_azure(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ts, p, o = [], [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: Azure trace is missing columns {sorted(missing)}")
        for row in reader:
            ts.append(_parse_azure_ts(row["TIMESTAMP"]))
            p.append(int(row["ContextTokens"]))
            o.append(int(row["GeneratedTokens"]))
    return _finish(path, ts, p, o)


def read_mooncake(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ts, p, o = [], [], []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts.append(float(row["timestamp"]) / 1000.0)
                p.append(int(row["input_length"]))
                o.append(int(row["output_length"]))
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}:{i + 1}: bad Mooncake row ({e})") from None
    return _finish(path, ts, p, o)


def _finish(path, ts, p, o):
    if not ts:
        raise ValueError(f"{path}: trace has no rows")
    t = np.asarray(ts)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0]
    return t, np.asarray(p)[order], np.asarray(o)[order]


def read_trace(path: str | Path, fmt: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace file not found: {path}")
    if fmt == "auto":
        fmt = "mooncake" if path.suffix in (".jsonl", ".json") else "azure"
    return read_mooncake(path) if fmt == "mooncake" else read_azure(path)
