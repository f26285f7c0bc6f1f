"""The functions that the task files beside this one name (lm-eval's `!function utils.NAME`):
the shipped BIG-bench tasks (../mc/bigbench) read by quantpipe's own reader, so lm-eval
sees the prompts, choices and correct answers that `quantpipe eval` scores."""

from pathlib import Path

import datasets

from quantpipe.formats.bigbench import read_task

TASKS = Path(__file__).resolve().parent.parent / "mc" / "bigbench"


def load(task: str, **_) -> datasets.DatasetDict:
    """The task's items as lm-eval docs (split `test`), in the file's order."""
    items = read_task(TASKS / f"{task}.json.gz")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(
        [{"context": it.context, "choices": it.choices, "gold": sorted(it.correct)} for it in items])})


def doc_to_text(doc: dict) -> str:
    return doc["context"]


def doc_to_choice(doc: dict) -> list[str]:
    return list(doc["choices"])


def doc_to_target(doc: dict) -> list[int]:
    return list(doc["gold"])  # every correct choice: lm-eval counts a pick of any of them
