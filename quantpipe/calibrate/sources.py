"""Reading logs: every supported format becomes a stream of `Record`s, bad lines counted.

Formats:
- request-log: `quantpipe serve --request-log` lines (status, request body, output text)
- chat: OpenAI-style `{"messages": [...]}`, the reply as the last assistant message or
  in a `response` field
- batch: OpenAI Batch API input and output files, joined on `custom_id`
- jsonl / csv / parquet: any table with `--text-field` (and optionally `--label-field`)

JSON lines are parsed one by one (not through `datasets`' JSON builder) because a single
malformed line must be skipped and reported by number, not abort the whole file. CSV and
Parquet are read in blocks of rows, so files larger than memory work: Parquet through
pyarrow (so any pyarrow filesystem path too), CSV through `datasets` (its type inference).
Line blocks and row blocks are what the featurizing workers (local or on Ray) take.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from quantpipe.formats import request_log
from quantpipe.manifest import StageError, sha256_file

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass
class Record:
    source_id: str
    file: int  # index into the input list
    line: int  # 1-based line (or row) number in that file
    status: str = "ok"
    endpoint: str | None = None
    model: str | None = None
    messages: list[dict] | None = None  # chat: the prompt messages (reply not included)
    prompt: str | None = None  # completions
    reply: str = ""  # what the model answered
    text: str | None = None  # generic tables: the text itself
    labels: dict[str, str] = field(default_factory=dict)  # metadata.* (and `label`)
    user: str | None = None


class BadLine(Exception):
    pass


@dataclass
class ReadStats:
    lines: int = 0
    bad: list[tuple[int, int, str]] = field(default_factory=list)  # (file, line, reason)
    torn_tail: int = 0  # a last line cut by an interrupted write, skipped as the log format allows
    unanswered: int = 0  # batch inputs without an output line


def is_uri(path: str) -> bool:
    """An object-store or other pyarrow filesystem path (s3://bucket/key, gs://..., file:///...)."""
    return "://" in path


def _filesystem(uri: str):
    from pyarrow import fs

    try:
        return fs.FileSystem.from_uri(uri)
    except (ValueError, OSError, ImportError) as e:
        raise StageError(f"--logs {uri}: no filesystem for this address ({e})") from None


def _expand_uri(pattern: str) -> list[str]:
    """A URI, or a glob in its last part, through the pyarrow filesystem its scheme names."""
    from pyarrow import fs

    filesystem, path = _filesystem(pattern)
    prefix = pattern[: len(pattern) - len(path)] if pattern.endswith(path) else pattern.split("://")[0] + "://"
    try:
        if glob.has_magic(path):
            folder, name = path.rsplit("/", 1) if "/" in path else ("", path)
            if glob.has_magic(folder):
                raise StageError(f"--logs {pattern}: a URI may have a wildcard in its last part only")
            infos = filesystem.get_file_info(fs.FileSelector(folder, allow_not_found=True))
            return sorted(prefix + i.path for i in infos
                          if i.type == fs.FileType.File and fnmatch.fnmatchcase(i.base_name, name))
        info = filesystem.get_file_info(path)
    except OSError as e:
        raise StageError(f"--logs {pattern}: cannot be listed ({e})") from None
    if info.type != fs.FileType.File:
        raise StageError(f"--logs {pattern}: no such file")
    return [pattern]


def expand_inputs(patterns: list[str]) -> list[str]:
    if not patterns:
        raise StageError("logs: give at least one input file (--logs FILE...)")
    files: list[str] = []
    for p in patterns:
        if is_uri(p):
            matched = _expand_uri(p)
        else:
            matched = sorted(glob.glob(p)) if glob.has_magic(p) else [p]
        if not matched:
            raise StageError(f"--logs {p}: no file matches")
        for path in matched:
            if is_uri(path):
                files.append(path)
                continue
            if not os.path.isfile(path):
                raise StageError(f"--logs {path}: no such file")
            if not os.access(path, os.R_OK):
                raise StageError(f"--logs {path}: not readable")
            files.append(path)
    return list(dict.fromkeys(files))


def input_size(path: str) -> int:
    if not is_uri(path):
        return os.path.getsize(path)
    filesystem, p = _filesystem(path)
    return filesystem.get_file_info(p).size or 0


def input_sha256(path: str) -> str:
    """sha256 of an input's stored bytes (compressed as stored); a URI is streamed through its filesystem."""
    if not is_uri(path):
        return sha256_file(path)
    filesystem, p = _filesystem(path)
    h = hashlib.sha256()
    try:
        with filesystem.open_input_stream(p, compression=None) as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise StageError(f"--logs {path}: cannot be read ({e})") from None
    return h.hexdigest()


def uncompressed_name(path: str) -> str:
    for ext in (".gz", ".zst"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def _open_binary(path: str):
    if is_uri(path):  # pyarrow decompresses too (and closes the stream with its reader)
        filesystem, p = _filesystem(path)
        codec = "gzip" if path.endswith(".gz") else "zstd" if path.endswith(".zst") else None
        return filesystem.open_input_stream(p, compression=codec)
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True)
    return open(path, "rb")


def open_lines(path: str, option: str = "--logs") -> Iterator[tuple[int, str, bool]]:
    """(line number, line, complete) for a plain, .gz or .zst text file."""
    try:
        with io.TextIOWrapper(io.BufferedReader(_open_binary(path), 1 << 20), encoding="utf-8", errors="replace",
                              newline="\n") as f:
            for n, line in enumerate(f, 1):
                yield n, line, line.endswith("\n")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise StageError(f"{option} {path}: cannot be read ({e})") from None


def open_blocks(path: str, size: int = 1 << 20, option: str = "--logs") -> Iterator[tuple[int, bytes]]:
    """(number of its first line, bytes) of whole lines, about `size` bytes at a time.

    `block_lines` turns a block into what `open_lines` yields for it; reading blocks lets
    the bytes travel to worker processes without being split and decoded first.
    """
    first, rest = 1, b""
    try:
        with _open_binary(path) as f:
            while True:
                data = f.read(size)
                if not data:
                    break
                data = rest + data
                cut = data.rfind(b"\n") + 1
                if not cut:
                    rest = data
                    continue
                block, rest = data[:cut], data[cut:]
                yield first, block
                first += block.count(b"\n")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise StageError(f"{option} {path}: cannot be read ({e})") from None
    if rest:
        yield first, rest


def block_lines(first: int, block: bytes) -> list[tuple[int, str, bool]]:
    """A block of `open_blocks` as (line number, line, complete), like `open_lines`."""
    # A newline byte never sits inside a multi-byte UTF-8 character, so decoding whole
    # lines gives the text a stream decoder would.
    lines = block.decode("utf-8", errors="replace").split("\n")
    last = lines.pop()  # "" when the block ends with a newline
    out = [(first + i, line + "\n", True) for i, line in enumerate(lines)]
    if last:
        out.append((first + len(lines), last, False))
    return out


def detect_format(path: str, requested: str, text_field: str | None) -> str:
    fmt = _detect_format(path, requested, text_field)
    if fmt in TEXT_FIELD_FORMATS and not text_field:
        raise StageError(f"--logs {path}: a {fmt} file is a generic table and needs --text-field "
                         "(the field that holds each record's text)")
    return fmt


def _detect_format(path: str, requested: str, text_field: str | None) -> str:
    if requested != "auto":
        return requested
    base = uncompressed_name(path).lower()
    if base.endswith(".csv"):
        return "csv"
    if base.endswith(".parquet"):
        return "parquet"
    for _, line, _ in open_lines(path):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if request_log.is_record(obj):
            return "request-log"
        if "custom_id" in obj and ("body" in obj or "response" in obj):
            return "batch"
        if "messages" in obj:
            return "chat"
        if text_field:
            return "jsonl"
        raise StageError(f"--logs {path}: unknown format (not a request log, chat or batch file); "
                         f"for a generic table pass --text-field (keys found: {', '.join(sorted(obj))})")
    raise StageError(f"--logs {path}: no JSON object in the file; pass --format for CSV or Parquet")


def _content(c) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
    if c is None:
        return ""
    raise BadLine(f"message content must be a string or a list of parts, got {type(c).__name__}")


def _messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise BadLine("messages must be a non-empty list")
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadLine("each message needs a string role")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m.get("content"))})
    return out


def _labels(meta) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise BadLine("metadata must be an object")
    return {str(k): str(v) for k, v in meta.items()}


def _reply_of(resp) -> str:
    """A reply given as text, {"text": ...}, or a chat/completions response object."""
    if isinstance(resp, str):
        return resp
    if isinstance(resp, dict):
        if isinstance(resp.get("text"), str):
            return resp["text"]
        if isinstance(resp.get("content"), str):
            return resp["content"]
        choices = resp.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            c = choices[0]
            if isinstance(c.get("message"), dict):
                return _content(c["message"].get("content"))
            if isinstance(c.get("text"), str):
                return c["text"]
    raise BadLine("response must be a string, {text}, or a completion object with choices")


def parse_request_log(obj: dict, file: int, line: int) -> Record:
    try:
        request_log.version_of(obj)
    except ValueError as e:
        raise BadLine(str(e)) from None
    req, endpoint = obj["request"], obj["endpoint"]
    rec = Record(str(obj["id"]), file, line, status=str(obj["status"]), endpoint=endpoint,
                 model=obj.get("model"), labels=_labels(obj.get("metadata")), user=obj.get("user"))
    out = obj.get("output") or {}
    rec.reply = out.get("text") or "" if isinstance(out, dict) else ""
    if req is None:  # refused before its body was read
        if rec.status == "ok":
            raise BadLine("status ok without a request body")
        return rec
    if not isinstance(req, dict):
        raise BadLine("request must be an object")
    if endpoint == CHAT_ENDPOINT:
        rec.messages = _messages(req.get("messages"))
    elif endpoint == COMPLETIONS_ENDPOINT:
        p = req.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if not isinstance(p, str):  # token-id prompts carry no text to calibrate on
            raise BadLine("completions prompt is not text")
        rec.prompt = p
    else:
        raise BadLine(f"unknown endpoint {endpoint!r}")
    return rec


def parse_chat(obj: dict, file: int, line: int) -> Record:
    msgs = _messages(obj.get("messages"))
    rec = Record(str(obj.get("id", f"{file}:{line}")), file, line, endpoint=CHAT_ENDPOINT, model=obj.get("model"),
                 labels=_labels(obj.get("metadata")), user=obj.get("user"))
    for key in ("response", "completion", "output"):
        if key in obj:
            rec.messages, rec.reply = msgs, _reply_of(obj[key])
            return rec
    if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
        raise BadLine("chat line needs the reply as the last (assistant) message or a response field")
    rec.messages, rec.reply = msgs[:-1], msgs[-1]["content"]
    return rec


def _field(obj: dict, dotted: str):
    cur = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def parse_generic(obj: dict, file: int, line: int, text_field: str, label_field: str | None) -> Record:
    text = _field(obj, text_field)
    if not isinstance(text, str):
        raise BadLine(f"no string field {text_field!r}")
    rec = Record(str(obj.get("id", f"{file}:{line}")), file, line, text=text)
    if label_field:
        label = _field(obj, label_field)
        if label is not None:
            rec.labels["label"] = str(label)
    return rec


def read_file(path: str, file: int, fmt: str, cfg, stats: ReadStats, keys_seen: set[str],
              only: set[int] | None = None) -> Iterator[Record]:
    """Records of one file; malformed lines go to stats.bad instead. `only`: parse just these lines."""
    if fmt in TABLE_FORMATS:
        for first, rows in open_table_blocks(path, fmt):
            yield from table_records(rows, first, file, cfg, stats, keys_seen, only)
        return
    if fmt not in LINE_FORMATS:
        raise StageError(f"format {fmt!r} cannot be read line by line")
    for n, line, complete in open_lines(path):
        if only is not None and n not in only:
            continue
        rec = parse_line(line, file, n, complete, fmt, cfg, stats, keys_seen)
        if rec is not None:
            yield rec


LINE_FORMATS = ("request-log", "chat", "jsonl")
TABLE_FORMATS = ("csv", "parquet")
TEXT_FIELD_FORMATS = ("jsonl", *TABLE_FORMATS)  # generic tables: the text is in --text-field
TABLE_ROWS = 2048  # rows per block of a CSV or Parquet file


def parse_line(line: str, file: int, n: int, complete: bool, fmt: str, cfg, stats: ReadStats,
               keys_seen: set[str]) -> Record | None:
    """One line of a line-based format as a Record; None for a blank or malformed line (counted in stats)."""
    if not line.strip():
        return None
    stats.lines += 1
    try:
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise BadLine("not a JSON object")
        keys_seen.update(obj)
        if fmt == "request-log":
            return parse_request_log(obj, file, n)
        if fmt == "chat":
            return parse_chat(obj, file, n)
        return parse_generic(obj, file, n, cfg.text_field, cfg.label_field)
    except (ValueError, BadLine) as e:
        if not complete:  # the last line of a log cut by a crash: the format allows it
            stats.torn_tail += 1
            stats.lines -= 1
        else:
            stats.bad.append((file, n, str(e)[:200]))
    return None


def open_table_blocks(path: str, fmt: str, rows: int = TABLE_ROWS) -> Iterator[tuple[int, list[dict]]]:
    """(number of its first row, rows as dicts) of a CSV or Parquet file, `rows` at a time."""
    import pyarrow as pa

    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            if is_uri(path):
                filesystem, p = _filesystem(path)
                source = filesystem.open_input_file(p)
            else:
                source = open(path, "rb")
            with source:
                first = 1
                for batch in pq.ParquetFile(source).iter_batches(batch_size=rows):
                    block = batch.to_pylist()
                    yield first, block
                    first += len(block)
            return
        import datasets

        datasets.disable_progress_bars()
        block, first = [], 1
        for row in datasets.load_dataset(fmt, data_files=path, split="train", streaming=True):
            block.append(row)
            if len(block) == rows:
                yield first, block
                block, first = [], first + rows
        if block:
            yield first, block
    except (OSError, ValueError, pa.ArrowException) as e:
        raise StageError(f"--logs {path}: cannot be read as {fmt} ({e})") from None


def table_records(rows: list[dict], first: int, file: int, cfg, stats: ReadStats, keys_seen: set[str],
                  only: set[int] | None = None) -> Iterator[Record]:
    """The Records of a block of table rows numbered from `first`; rows without the text go to stats.bad."""
    for n, row in enumerate(rows, first):
        if only is not None and n not in only:
            continue
        stats.lines += 1
        keys_seen.update(row)
        try:
            yield parse_generic(row, file, n, cfg.text_field, cfg.label_field)
        except BadLine as e:
            stats.bad.append((file, n, str(e)))


def read_batch(paths: list[tuple[int, str]], stats: ReadStats, keys_seen: set[str]) -> Iterator[Record]:
    """OpenAI Batch API files: input lines (custom_id, body) joined with output lines (custom_id, response)."""
    inputs: dict[str, tuple[int, int, dict]] = {}
    outputs: dict[str, dict] = {}
    for file, path in paths:
        for n, line, complete in open_lines(path):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str):
                    raise BadLine("batch line without a string custom_id")
                keys_seen.update(obj)
                if "body" in obj:
                    inputs[obj["custom_id"]] = (file, n, obj)
                elif "response" in obj or "error" in obj:
                    outputs[obj["custom_id"]] = obj
                else:
                    raise BadLine("batch line is neither an input (body) nor an output (response)")
            except (ValueError, BadLine) as e:
                if complete:
                    stats.bad.append((file, n, str(e)[:200]))
                else:
                    stats.torn_tail += 1
    for cid, (file, n, obj) in inputs.items():
        out = outputs.get(cid)
        if out is None:
            stats.unanswered += 1
            continue
        try:
            body = obj["body"]
            if not isinstance(body, dict):
                raise BadLine("batch body must be an object")
            resp = out.get("response") or {}
            ok = out.get("error") is None and resp.get("status_code") == 200
            rec = Record(cid, file, n, status="ok" if ok else "error", endpoint=obj.get("url"), model=body.get("model"),
                         labels=_labels(body.get("metadata")), user=body.get("user"))
            if ok:
                rec.reply = _reply_of(resp.get("body"))
            if "messages" in body:
                rec.messages = _messages(body["messages"])
                rec.endpoint = CHAT_ENDPOINT
            elif isinstance(body.get("prompt"), str):
                rec.prompt = body["prompt"]
                rec.endpoint = COMPLETIONS_ENDPOINT
            else:
                raise BadLine("batch body has neither messages nor a text prompt")
            yield rec
        except BadLine as e:
            stats.bad.append((file, n, str(e)))
