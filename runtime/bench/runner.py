"""Send materialized requests to an OpenAI-compatible server: open loop or closed loop.

Open loop follows the workload's arrival schedule regardless of how the server copes, so
queueing shows up as latency (and, with a client concurrency cap, as schedule lag).
Closed loop keeps N requests in flight. Every request yields one RequestRecord; records
are appended to `Runner.records` as they are created so an interrupted run keeps them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quantpipe.runtime.bench.http import HTTPClient, HTTPError
from quantpipe.runtime.bench.records import RequestRecord
from quantpipe.runtime.workload.materialize import Request

_json_decode = json.JSONDecoder().decode  # per SSE event: the generator's hottest call


class BenchError(Exception):
    """A problem the user must fix (unreachable server, bad arguments): message is shown as is."""


class MalformedSSE(Exception):
    pass


@dataclass
class Target:
    base_url: str
    endpoint: str = "completions"  # completions | chat
    model: str | None = None  # None: first model from /v1/models
    timeout_s: float = 300.0  # per request, whole response
    stream: bool = True
    send_token_ids: bool = False  # completions only: send prompt_ids instead of text
    ignore_eos: bool = True
    tokenizer: Any = None  # counts output tokens when the server sends no usage


class Runner:
    def __init__(self, target: Target, on_done: Callable[[RequestRecord], None] | None = None):
        self.target = target
        self.client = HTTPClient(target.base_url)
        self.clock0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.on_done = on_done
        self.path = "/v1/chat/completions" if target.endpoint == "chat" else "/v1/completions"
        # Multi-turn sessions: request index -> the conversation so far, ending with the
        # server's real reply; the next turn extends it, then drops it.
        self._history: dict[int, list[dict] | str] = {}
        if target.endpoint not in ("chat", "completions"):
            raise BenchError(f"endpoint must be completions or chat, got {target.endpoint!r}")

    def now(self) -> float:
        return time.perf_counter() - self.clock0

    async def preflight(self) -> str:
        """Check the server answers and pick the model; raises BenchError with a clear message."""
        try:
            async with asyncio.timeout(10):
                resp = await self.client.get("/v1/models")
                body = await resp.read()
        except (HTTPError, TimeoutError) as e:
            raise BenchError(f"server at {self.target.base_url} is unreachable: {e or 'timeout'}") from None
        if resp.status != 200:
            raise BenchError(f"server at {self.target.base_url} answered GET /v1/models with HTTP {resp.status}")
        if self.target.model is None:
            try:
                self.target.model = json.loads(body)["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise BenchError("could not read a model id from /v1/models; pass --model") from None
        return self.target.model

    async def aclose(self) -> None:
        await self.client.aclose()

    # ---- one request ----------------------------------------------------------------
    def _conversation(self, req: Request) -> list[dict] | str:
        """Chat messages or prompt text this request sends: its planned prompt, or for a later
        turn of a session, the conversation so far with the server's real replies plus the
        turn's new text (the planned stand-in reply only when the previous turn failed)."""
        prev = self._history.pop(req.spec.parent, None) if req.spec.parent >= 0 else None
        if self.target.endpoint == "chat":
            if prev is None:
                return [{"role": "user", "content": req.prompt}]
            return [*prev, {"role": "user", "content": req.turn_text}]
        return req.prompt if prev is None else prev + req.turn_text

    def _body(self, req: Request, conversation: list[dict] | str | None = None) -> bytes:
        t = self.target
        conv = self._conversation(req) if conversation is None else conversation
        d: dict[str, Any] = {"model": t.model, "max_tokens": req.output_tokens, "temperature": 0.0,
                             "stream": t.stream}
        if t.ignore_eos:
            d["ignore_eos"] = True
        if t.stream:
            d["stream_options"] = {"include_usage": True}
        if t.endpoint == "chat":
            d["messages"] = conv
        else:
            # Token ids only for single-shot prompts: a real reply exists only as text.
            d["prompt"] = req.prompt_ids if t.send_token_ids and req.spec.session < 0 else conv
        return json.dumps(d).encode()

    def _record(self, req: Request, stage: str, intended: float) -> RequestRecord:
        s = req.spec
        rec = RequestRecord(index=len(self.records), stage=stage, intended_send=intended,
                            planned_prompt_tokens=s.prompt_tokens, planned_output_tokens=s.output_tokens,
                            session=s.session, turn=s.turn, prefix_group=s.prefix_group)
        self.records.append(rec)
        return rec

    async def send(self, req: Request, rec: RequestRecord, body: bytes | None = None) -> None:
        rec.actual_send = self.now()
        texts: list[str] = []
        conv = None
        if req.spec.session >= 0:  # built now: a later turn needs the previous turn's reply
            conv = self._conversation(req)
            body = self._body(req, conv)
        try:
            async with asyncio.timeout(self.target.timeout_s):
                resp = await self.client.request("POST", self.path, body or self._body(req),
                                                 {"Content-Type": "application/json"})
                rec.status = resp.status
                if resp.status != 200:
                    raw = await resp.read(1 << 16)
                    rec.error = f"HTTP {resp.status}: {_error_message(raw)}"
                elif self.target.stream:
                    await self._consume_sse(resp, rec, texts)
                else:
                    obj = json.loads(await resp.read())
                    rec.first_token = self.now()
                    c = (obj.get("choices") or [{}])[0]
                    texts.append(c.get("text") or (c.get("message") or {}).get("content") or "")
                    self._usage(obj.get("usage"), rec)
        except TimeoutError:
            rec.timed_out = True
            rec.error = f"timeout after {self.target.timeout_s:g}s"
        except (HTTPError, MalformedSSE) as e:
            rec.error = str(e)
        except ValueError as e:  # non-JSON body on a 200
            rec.error = f"bad response body: {e}"
        except asyncio.CancelledError:
            rec.error = rec.error or "cancelled"
            raise
        finally:
            rec.end = self.now()
            if conv is not None and rec.ok:
                reply = "".join(texts)
                self._history[req.spec.index] = (
                    [*conv, {"role": "assistant", "content": reply}] if isinstance(conv, list) else conv + reply)
            if not rec.prompt_tokens_source:
                rec.prompt_tokens = len(req.prompt_ids)
                rec.prompt_tokens_source = f"tokenizer:{req.tokenizer_source}"
            if not rec.output_tokens_source:
                tok = self.target.tokenizer
                if tok is not None and texts:
                    rec.output_tokens = len(tok.encode("".join(texts)))
                    rec.output_tokens_source = f"tokenizer:{getattr(tok, 'source', '?')}"
                else:
                    rec.output_tokens = len(rec.chunk_times)
                    rec.output_tokens_source = "chunks"
            if self.on_done:
                self.on_done(rec)

    async def _consume_sse(self, resp, rec: RequestRecord, texts: list[str]) -> None:
        saw_done = False
        try:
            async for line in resp.iter_lines():
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    saw_done = True
                    continue  # keep reading so the connection ends cleanly and is reused
                try:
                    obj = _json_decode(data.decode())  # str: skips json.loads' encoding sniffing
                except ValueError:
                    raise MalformedSSE(f"malformed SSE data: {data[:80]!r}") from None
                if not isinstance(obj, dict):
                    raise MalformedSSE(f"malformed SSE data: {data[:80]!r}")
                if "error" in obj:
                    rec.error = f"stream error: {_error_message(json.dumps(obj).encode())}"
                choices = obj.get("choices")
                if choices:
                    c = choices[0]
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        t = self.now()
                        if rec.first_token is None:
                            rec.first_token = t
                        rec.chunk_times.append(t)
                        texts.append(text)
                self._usage(obj.get("usage"), rec)
        finally:
            resp.release()
        if not saw_done and not rec.error:
            rec.error = "stream ended without data: [DONE]"

    @staticmethod
    def _usage(usage, rec: RequestRecord) -> None:
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            rec.output_tokens = int(usage["completion_tokens"])
            rec.output_tokens_source = "usage"
            if usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(usage["prompt_tokens"])
                rec.prompt_tokens_source = "usage"

    # ---- loops ------------------------------------------------------------------------
    async def open_loop(self, reqs: list[Request], stage: str = "run",
                        max_concurrency: int | None = None) -> list[RequestRecord]:
        """Send each request at its arrival time (relative to now); returns when all finished."""
        self._history.clear()  # indices restart with each stage's requests
        # Serialize up front: keeps dispatch cheap. Session turns are built when sent.
        bodies = [self._body(r) if r.spec.session < 0 else None for r in reqs]
        base = self.now()  # after serializing, which takes tens of ms for thousands of requests
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        done: dict[int, asyncio.Event] = {}
        recs: list[RequestRecord | None] = [None] * len(reqs)
        tasks: list[asyncio.Task] = []

        async def go(i: int, rec: RequestRecord) -> None:
            try:
                if sem:
                    async with sem:
                        await self.send(reqs[i], rec, bodies[i])
                else:
                    await self.send(reqs[i], rec, bodies[i])
            finally:
                done[reqs[i].spec.index].set()

        async def follow_up(i: int) -> None:
            """A later turn: due think_time after its parent finished (and not before plan)."""
            r = reqs[i]
            await done[r.spec.parent].wait()
            parent = recs[pos[r.spec.parent]]
            due = max(base + r.arrival_s, (parent.end or self.now()) + r.spec.think_time_s)
            rec = recs[i] = self._record(r, stage, due)
            await asyncio.sleep(max(0.0, due - self.now()))
            await go(i, rec)

        pos = {r.spec.index: i for i, r in enumerate(reqs)}
        for r in reqs:
            done[r.spec.index] = asyncio.Event()
        try:
            for i, r in enumerate(reqs):
                if r.spec.parent >= 0 and r.spec.parent in pos:
                    tasks.append(asyncio.ensure_future(follow_up(i)))
                    continue
                due = base + r.arrival_s
                delay = due - self.now()
                if delay > 0.0002:
                    await asyncio.sleep(delay)
                recs[i] = self._record(r, stage, due)
                tasks.append(asyncio.ensure_future(go(i, recs[i])))
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [r for r in recs if r is not None]

    async def closed_loop(self, reqs: list[Request], concurrency: int, stage: str = "run",
                          duration_s: float | None = None) -> list[RequestRecord]:
        """`concurrency` workers each send the next request as soon as their last finished.

        A later turn of a session first waits for its previous turn (taken earlier, so in
        flight in another worker) to finish: it must carry that turn's reply."""
        self._history.clear()
        it = iter(reqs)
        stop_at = self.now() + duration_s if duration_s else None
        recs: list[RequestRecord] = []
        done = {r.spec.index: asyncio.Event() for r in reqs if r.spec.session >= 0}

        async def worker() -> None:
            for r in it:
                try:
                    if stop_at is not None and self.now() >= stop_at:
                        return
                    if r.spec.parent in done:
                        await done[r.spec.parent].wait()
                    rec = self._record(r, stage, self.now())
                    recs.append(rec)
                    await self.send(r, rec)
                finally:
                    if r.spec.index in done:
                        done[r.spec.index].set()

        workers = [asyncio.ensure_future(worker()) for _ in range(max(1, concurrency))]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        return recs


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:200]
    except ValueError:
        return raw[:200].decode("utf-8", "replace")
