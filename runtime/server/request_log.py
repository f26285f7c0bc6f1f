"""The production request log: one JSON object per line, per request, off the hot path.

The event loop only builds a dict and puts it on a bounded queue; a writer thread
serializes and appends batches of complete lines with one os.write each, so the engine
thread and the event loop never wait on the disk. Guarantees, and how:

- A line is complete or absent. Batches end in a newline and are written with one
  syscall; a short write (disk full) is truncated back to the last complete line. A
  SIGKILL can cut only the write in progress, so at most the last line is torn, and
  reopening the file trims such a tail before anything is appended after it.
- The file is created owner-only (0600): it holds prompts and replies.
- Size-based rotation: PATH -> PATH.1 -> ... -> PATH.N, the oldest dropped.
- Never blocking serving: a full queue or a failing disk drops lines, counted in
  `quantpipe:request_log_dropped_total`, with one warning per minute at most.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import stat
import threading
import time
from dataclasses import dataclass

from quantpipe.formats import request_log

log = logging.getLogger("quantpipe.runtime.server")

_BATCH_LINES = 512
_WARN_EVERY_S = 60.0


@dataclass
class RequestLogConfig:
    path: str
    max_bytes: int = 256 << 20  # rotate past this size; 0: never
    backups: int = 5
    max_pending: int = 65536  # lines waiting for the writer before new ones are dropped

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"request_log_max_bytes must be >= 0, got {self.max_bytes}")
        if self.backups < 0:
            raise ValueError(f"request_log_backups must be >= 0, got {self.backups}")
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise ValueError(f"--request-log {self.path}: the directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"--request-log {self.path}: the directory {parent} is not writable")
        if os.path.isdir(self.path):
            raise ValueError(f"--request-log {self.path}: is a directory, not a file")
        try:  # fail at start-up, not at the first request
            os.close(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600))
        except OSError as e:
            raise ValueError(f"--request-log {self.path}: cannot be opened for appending ({e.strerror})") from None


class RequestLog:
    """Appends request records to a JSONL file from a writer thread."""

    def __init__(self, config: RequestLogConfig, on_written=None, on_dropped=None):
        self.config = config
        self._on_written = on_written or (lambda n: None)
        self._on_dropped = on_dropped or (lambda n: None)
        self._queue: queue.Queue[dict | None] = queue.Queue(config.max_pending)
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size
        self._last_warning = -_WARN_EVERY_S
        self._lock = threading.Lock()  # drops are counted from the event loop and the writer
        self.written = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="quantpipe-request-log", daemon=True)
        self._thread.start()

    # -- the event loop's side --------------------------------------------------------

    def write(self, record: dict) -> None:
        """Queue one record; never blocks. Dropped (and counted) when the writer is behind."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._dropped(1, "the writer is behind")

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer and close the file."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch = [first]
            while first is not None and len(batch) < _BATCH_LINES:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                if batch[-1] is None:
                    break
            stop = batch[-1] is None
            records = [r for r in batch if r is not None]
            if records:
                self._append(records)
            if stop:
                return

    def _append(self, records: list[dict]) -> None:
        lines = []
        for r in records:
            try:
                lines.append(json.dumps(r, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n")
            except (TypeError, ValueError) as e:  # a bug upstream; never let it stop the writer
                log.error("request log: record not serializable (%s); dropped", e)
                self._dropped(1, "a record was not serializable")
        if not lines:
            return
        data = "".join(lines).encode("utf-8")
        try:
            if self.config.max_bytes and self._size and self._size + len(data) > self.config.max_bytes:
                self._rotate()
            self._write_all(data)
        except OSError as e:
            self._dropped(len(lines), f"{e.strerror or e}")
            return
        self.written += len(lines)
        self._on_written(len(lines))

    def _write_all(self, data: bytes) -> None:
        start = self._size
        view = memoryview(data)
        done = 0
        try:
            while done < len(data):
                n = os.write(self._fd, view[done:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, "no space left on device")
                done += n
        except OSError:
            if done and self._regular():
                os.ftruncate(self._fd, start)  # take back the partial batch: no torn line stays
            raise
        self._size = start + done

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = -1
        path, n = self.config.path, self.config.backups
        if n == 0:
            os.unlink(path)
        else:
            for i in range(n - 1, 0, -1):
                if os.path.exists(f"{path}.{i}"):
                    os.replace(f"{path}.{i}", f"{path}.{i + 1}")
            os.replace(path, f"{path}.1")
        self._fd = self._open()
        self._size = 0

    def _open(self) -> int:
        fd = os.open(self.config.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, 0o600)  # an existing file too: it holds prompts and replies
            self._trim_torn_tail(fd)
        return fd

    def _regular(self) -> bool:
        return stat.S_ISREG(os.fstat(self._fd).st_mode)

    def _trim_torn_tail(self, fd: int) -> None:
        """A SIGKILL mid-write can leave a last line without its newline: cut it off."""
        size = os.fstat(fd).st_size
        if size == 0:
            return
        with open(self.config.path, "rb") as f:
            end = size
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                chunk = f.read(end - start)
                if end == size and chunk.endswith(b"\n"):
                    return
                nl = chunk.rfind(b"\n")
                if nl >= 0:
                    keep = start + nl + 1
                    break
                end = start
            else:
                keep = 0
        os.ftruncate(fd, keep)
        log.warning("request log %s: removed a torn last line (%d bytes) left by an interrupted write",
                    self.config.path, size - keep)

    def _dropped(self, n: int, why: str) -> None:
        with self._lock:
            self.dropped += n
            now = time.monotonic()
            warn = now - self._last_warning >= _WARN_EVERY_S
            if warn:
                self._last_warning = now
        self._on_dropped(n)
        if warn:
            log.warning("request log %s: dropping lines (%s); %d dropped so far, serving goes on",
                        self.config.path, why, self.dropped)


def log_record(request_id: str, created: float, endpoint: str, model: str, status: str, body: dict | None,
               out, error, prep, responder, total_s: float) -> dict:
    """One request's line: what was asked, what the client got, how long it took.

    status: ok, error (4xx/5xx after parsing), rejected (429/503 admission), aborted
    (client disconnect) or timeout. `body` is the request as sent (None when it was
    refused before being read); `out` the newest RequestOutput, `responder` what was
    actually delivered.
    """
    usage = {"prompt_tokens": len(prep.prompt_ids) if prep is not None else 0, "completion_tokens": 0,
             "cached_tokens": 0}
    timings = {"queue_s": None, "ttft_s": None, "total_s": round(total_s, 6)}
    if out is not None:
        usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.outputs[0].token_ids),
                 "cached_tokens": out.metrics.num_cached_tokens}
        t = out.metrics
        if t.first_scheduled_time is not None:
            timings["queue_s"] = round(max(0.0, t.first_scheduled_time - t.arrival_time), 6)
        if t.first_token_time is not None:
            timings["ttft_s"] = round(max(0.0, t.first_token_time - t.arrival_time), 6)
    return request_log.record(
        request_id=request_id, created=created, endpoint=endpoint, model=model, status=status, request=body,
        output_text=responder.delivered_text(out) if responder is not None else "",
        finish_reason=responder.delivered_finish_reason if responder is not None else None,
        usage=usage, timings=timings, metadata=_labels(body, "metadata"), user=_labels(body, "user"),
        error=None if error is None else {"status": error.status, "message": error.message, "code": error.code})


def _labels(body: dict | None, key: str):
    """body[key] when the request carried it in a valid form (validation may have refused it)."""
    value = body.get(key) if isinstance(body, dict) else None
    if key == "metadata":
        ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        return value if ok else {}
    return value if isinstance(value, str) else None
