"""LLMEngine driven from one background thread, fed and drained from asyncio.

The engine is not thread-safe, so exactly one thread (the "engine thread") touches it.
The event loop hands it work through a thread-safe FIFO inbox (adds and aborts, in
order) and wakes it with an Event; the thread never busy-waits when idle. After every
step the thread posts that step's outputs to the loop in one call_soon_threadsafe
call, which puts each into its request's asyncio.Queue. Outputs are cumulative (text,
token ids, logprobs so far), so a consumer that falls behind just takes the newest.

Admission accounting ("queued" = admitted but not yet scheduled) lives here because
both sides touch it: the loop reserves on admit, the engine thread releases when the
scheduler first picks a request up (or it ends). A lock keeps the totals consistent.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from quantpipe.runtime.llm_engine import LLMEngine
from quantpipe.runtime.outputs import RequestOutput
from quantpipe.runtime.sampling_params import SamplingParams
from quantpipe.runtime.server.metrics import ServerMetrics

log = logging.getLogger("quantpipe.runtime.server")


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    cost_tokens: int = 0  # prompt + max_tokens: what it counts against --max-queued-tokens


class EngineError(Exception):
    """The engine refused a request (status 400), failed a step (500), or is shutting down (503)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class RequestStream:
    """The event-loop end of one request."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | Exception) -> None:
        self._queue.put_nowait(item)

    async def next(self, timeout: float | None = None) -> RequestOutput:
        """The newest output once at least one new one arrived; raises TimeoutError or EngineError."""
        # asyncio.timeout rather than wait_for, which on 3.11 can swallow a cancellation
        # (a client that disconnects) arriving as the item does.
        async with asyncio.timeout(timeout):
            item = await self._queue.get()
        # Coalesce: cumulative outputs make older ones redundant; an error ends the stream.
        while not isinstance(item, Exception) and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, idle_wait_s: float = 1.0):
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop owned
        # Admission accounting, shared by both threads.
        self._lock = threading.Lock()
        self._queued: dict[str, int] = {}  # request id -> cost tokens
        self._queued_tokens = 0
        # Engine-thread owned.
        self._unscheduled: set[str] = set()
        # The engine's cumulative counters as of the last step (a new engine's are all 0),
        # turned into per-step increments for the Prometheus counters.
        self._seen = dict.fromkeys(("prompt_tokens", "generation_tokens", "batched_tokens", "prefix_queries",
                                    "prefix_hits", "preemptions"), 0)
        self._bytes_per_block = engine.kv_cache_bytes // engine.pool.num_blocks
        self.alive = False

    # -- lifecycle (event loop) ----------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="quantpipe-engine", daemon=True)
        self.alive = True
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.alive = False

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    # -- admission (event loop) ----------------------------------------------------------

    def queue_load(self) -> tuple[int, int]:
        with self._lock:
            return len(self._queued), self._queued_tokens

    def try_admit(self, cost_tokens: int, max_requests: int | None, max_tokens: int | None,
                  count: int = 1) -> str | None:
        """Check the queue limits for `count` requests costing `cost_tokens` together; None
        when there is room, else which limit is full.

        The reservation itself happens in add(); both run on the loop thread with no
        await in between, so nothing can slip in between check and reserve.
        """
        n, tokens = self.queue_load()
        if max_requests is not None and n + count > max_requests:
            return f"{n} requests are already queued (--max-queued-requests {max_requests})"
        if max_tokens is not None and tokens + cost_tokens > max_tokens:
            return (f"{tokens} tokens are already queued; this request adds {cost_tokens} "
                    f"(--max-queued-tokens {max_tokens})")
        return None

    def add(self, req: EngineRequest) -> RequestStream:
        stream = RequestStream(req.request_id)
        self._streams[req.request_id] = stream
        with self._lock:
            self._queued[req.request_id] = req.cost_tokens
            self._queued_tokens += req.cost_tokens
        self._inbox.put(("add", req))
        self._wake.set()  # after put: the engine thread clears before it drains
        return stream

    def abort(self, request_id: str, notify: EngineError | None = None) -> bool:
        """Stop a request; its blocks are freed before the engine's next step. Idempotent.

        True when it was still live. With `notify`, its stream receives that error (used
        when the server, not the client, ends it, so the handler can still answer).
        """
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.finished:
            return False
        self._release(request_id)
        self._inbox.put(("abort", request_id))
        self._wake.set()
        if notify is not None:
            stream.put(notify)
        return True

    def abort_all(self, message: str) -> int:
        ids = list(self._streams)
        for rid in ids:
            self.abort(rid, EngineError(message, 503))
        return len(ids)

    def _release(self, request_id: str) -> None:
        with self._lock:
            self._queued_tokens -= self._queued.pop(request_id, 0)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    def _deliver_error(self, request_id: str, message: str, status: int) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(EngineError(message, status))

    # -- engine thread ----------------------------------------------------------------------

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not eng.has_unfinished_requests():
                    self._publish_gauges()
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                try:
                    outputs = eng.step()
                except Exception as e:  # a bug, or OOM: fail what is running, keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}", 500)
                    continue
                self._after_step(outputs)
        finally:
            self._fail_all("server shutting down", 503)
            while True:  # requests handed in after the last drain
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self._release(item.request_id)
                    self._post(self._deliver_error, item.request_id, "server shutting down", 503)
            self.alive = False

    def _drain_inbox(self) -> None:
        eng = self.engine
        changed = False
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            changed = True
            if kind == "add":
                req: EngineRequest = item
                try:
                    eng.add_request(req.prompt_token_ids, req.params, request_id=req.request_id,
                                    arrival_time=req.arrival_time, priority=req.priority)
                except Exception as e:
                    self._release(req.request_id)
                    self._post(self._deliver_error, req.request_id, str(e), 400 if isinstance(e, ValueError) else 500)
                else:
                    self._unscheduled.add(req.request_id)
            else:  # abort
                eng.abort_request(item)
                self._unscheduled.discard(item)
        if changed:
            self._publish_gauges()

    def _engine_counters(self) -> dict[str, int]:
        eng = self.engine
        return {"prompt_tokens": eng.stats["prompt_tokens"], "generation_tokens": eng.stats["generation_tokens"],
                "batched_tokens": eng.stats["batched_tokens"], "prefix_queries": eng.pool.num_queries,
                "prefix_hits": eng.pool.num_hits, "preemptions": eng.scheduler.num_preemptions}

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        eng, m = self.engine, self.metrics
        now = self._engine_counters()
        step = {k: v - self._seen[k] for k, v in now.items()}
        self._seen = now
        m.prompt_tokens.inc(step["prompt_tokens"])
        m.generation_tokens.inc(step["generation_tokens"])
        m.iteration_tokens.observe(step["batched_tokens"])
        m.prefix_queries.inc(step["prefix_queries"])
        m.prefix_hits.inc(step["prefix_hits"])
        m.preemptions.inc(step["preemptions"])
        # Requests the scheduler picked up no longer count against the queue limits.
        for rid in list(self._unscheduled):
            r = eng.scheduler.requests.get(rid)
            if r is None or r.first_scheduled_time is not None:
                self._unscheduled.discard(rid)
                self._release(rid)
        for out in outputs:
            if out.finished:
                m.finished(out)
        self._publish_gauges()
        if outputs:
            self._post(self._deliver, outputs)

    def _publish_gauges(self) -> None:
        eng, m = self.engine, self.metrics
        m.running.set(eng.scheduler.num_running)
        # Not yet handed over counts as waiting too (qsize may include an abort: a gauge, not an invariant).
        m.waiting.set(eng.scheduler.num_waiting + self._inbox.qsize())
        used = eng.pool.num_used
        m.kv_blocks_used.set(used)
        m.kv_blocks_total.set(eng.pool.num_blocks)
        m.kv_usage.set(used / eng.pool.num_blocks)
        m.kv_bytes_used.set(used * self._bytes_per_block)

    def _fail_all(self, message: str, status: int) -> None:
        eng = self.engine
        for rid in list(eng.tracked):
            eng.abort_request(rid)
            self._release(rid)
            self._post(self._deliver_error, rid, message, status)
        self._unscheduled.clear()
        self._publish_gauges()
