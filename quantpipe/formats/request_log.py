"""The production request log: one JSON line per request, written by `quantpipe serve
--request-log` and read by `quantpipe calibrate`.

    {"format": "quantpipe-request-log/1", "id", "created", "endpoint", "model", "status",
     "request": the body as sent (null when refused before it was read),
     "output": {"text", "finish_reason"}, "usage": {...}, "timings": {...},
     "metadata": {...}, ["user"], ["error": {"status", "message", "code"}]}

Lines written before the `format` field existed (version 0) carry the same fields and are
read as such; a line of a later version is refused by name, not guessed at.
"""

from __future__ import annotations

FORMAT = "quantpipe-request-log"
VERSION = 1
TAG = f"{FORMAT}/{VERSION}"
STATUSES = ("ok", "error", "rejected", "aborted", "timeout")
REQUIRED = ("id", "endpoint", "status", "request")


def record(*, request_id: str, created: float, endpoint: str, model: str, status: str, request: dict | None,
           output_text: str, finish_reason: str | None, usage: dict, timings: dict, metadata: dict,
           user: str | None = None, error: dict | None = None) -> dict:
    """One line's object; `status` must be one of STATUSES."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    out = {"format": TAG, "id": request_id, "created": round(created, 6), "endpoint": endpoint, "model": model,
           "status": status, "request": request, "output": {"text": output_text, "finish_reason": finish_reason},
           "usage": usage, "timings": timings, "metadata": metadata}
    if user is not None:
        out["user"] = user
    if error is not None:
        out["error"] = error
    return out


def is_record(obj: dict) -> bool:
    """Whether a line's object is a request-log record (of any version, for format detection)."""
    tag = obj.get("format")
    if isinstance(tag, str):
        return tag.split("/", 1)[0] == FORMAT
    return {"status", "request", "endpoint"} <= obj.keys()  # version 0: no format field


def version_of(obj: dict) -> int:
    """The record's version, checked: a ValueError names what is wrong (a later version, a
    missing field) so the reader can count the line as malformed with that reason."""
    tag = obj.get("format")
    if tag is None:
        version = 0
    else:
        name, _, number = str(tag).partition("/")
        if name != FORMAT or not number.isdigit():
            raise ValueError(f"format {tag!r} is not {FORMAT}/N")
        version = int(number)
        if version > VERSION:
            raise ValueError(f"written by a newer quantpipe ({tag}); this one reads up to {TAG}")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"request log line without {missing[0]!r}")
    if obj["status"] not in STATUSES:
        raise ValueError(f"status {obj['status']!r} is not one of {', '.join(STATUSES)}")
    return version
