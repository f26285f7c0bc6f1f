"""The request-log record (quantpipe.formats.request_log): the server writes it, calibrate
reads it; versioned, so a line from a later writer is refused by name, and lines written
before the version field existed still read."""

import json

import pytest

from quantpipe.calibrate.sources import ReadStats, detect_format, parse_line
from quantpipe.formats import request_log


def _line(**over) -> dict:
    rec = request_log.record(request_id="r1", created=1.0, endpoint="/v1/chat/completions", model="m", status="ok",
                             request={"messages": [{"role": "user", "content": "hi there"}]}, output_text="hello",
                             finish_reason="stop", usage={}, timings={}, metadata={"task": "chitchat"})
    rec.update(over)
    return rec


def _parse(obj: dict):
    stats = ReadStats()
    rec = parse_line(json.dumps(obj), 0, 7, True, "request-log", None, stats, set())
    return rec, stats


def test_a_written_record_reads_back_and_names_its_version(tmp_path):
    obj = _line()
    assert obj["format"] == "quantpipe-request-log/1" and request_log.version_of(obj) == 1
    rec, stats = _parse(obj)
    assert rec is not None and not stats.bad
    assert rec.labels == {"task": "chitchat"} and rec.reply == "hello"
    log = tmp_path / "requests.jsonl"
    log.write_text(json.dumps(obj) + "\n")
    assert detect_format(str(log), "auto", None) == "request-log"


def test_a_line_without_the_version_field_is_read_as_version_0():
    obj = _line()
    del obj["format"]
    assert request_log.is_record(obj) and request_log.version_of(obj) == 0
    rec, stats = _parse(obj)
    assert rec is not None and not stats.bad


@pytest.mark.parametrize("over, reason", [
    ({"format": "quantpipe-request-log/2"}, "written by a newer quantpipe (quantpipe-request-log/2); this one reads "
                                            "up to quantpipe-request-log/1"),
    ({"format": "other-log/1"}, "format 'other-log/1' is not quantpipe-request-log/N"),
    ({"status": "weird"}, "status 'weird' is not one of ok, error, rejected, aborted, timeout"),
])
def test_a_line_of_another_version_or_shape_is_counted_as_malformed_with_its_reason(over, reason):
    rec, stats = _parse(_line(**over))
    assert rec is None and stats.bad == [(0, 7, reason)]


def test_the_writer_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="status must be one of"):
        request_log.record(request_id="r", created=0.0, endpoint="/v1/completions", model="m", status="done",
                           request=None, output_text="", finish_reason=None, usage={}, timings={}, metadata={})
