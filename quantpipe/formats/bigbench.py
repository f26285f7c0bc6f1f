"""BIG-bench `task.json` (gzipped) multiple-choice tasks: read and validated here, for
quantpipe's own multiple-choice eval and for the lm-eval task files that serve the same
items to lm-evaluation-harness.

The prompt is built as BIG-bench builds it (task prefix, input prefix, input, output
prefix, a leading newline dropped); each choice is scored as the continuation
`" " + choice`. The correct choices are those with the highest target score.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path


class BigBenchError(ValueError):
    pass


@dataclass
class Item:
    context: str
    choices: list[str]
    correct: set[int]


def read_task(path: str | Path, limit: int | None = None) -> list[Item]:
    """The first `limit` (all when None) multiple-choice items of the task file at `path`."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            task = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BigBenchError(f"{path}: not a readable gzipped BIG-bench task.json ({e})") from None
    if not isinstance(task, dict) or not isinstance(task.get("examples"), list):
        raise BigBenchError(f"{path}: a BIG-bench task.json holds an object with a list 'examples'")
    prefix = task.get("task_prefix", "")
    q = task.get("example_input_prefix", "\nQ: ")
    a = task.get("example_output_prefix", "\nA: ").rstrip(" ")
    items = []
    for n, ex in enumerate(task["examples"][:limit]):
        scores = ex.get("target_scores") if isinstance(ex, dict) else None
        if not isinstance(scores, dict) or not scores or not isinstance(ex.get("input"), str):
            raise BigBenchError(f"{path}: example {n} has no 'input' text or no 'target_scores' (a multiple-choice "
                                f"example maps each choice to its score)")
        choices = list(scores)
        best = max(scores.values())
        items.append(Item((prefix + q + ex["input"] + a).lstrip("\n"), choices,
                          {i for i, c in enumerate(choices) if scores[c] == best}))
    return items
