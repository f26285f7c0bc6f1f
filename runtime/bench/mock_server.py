"""A fake OpenAI-compatible LLM server with a latency model, for testing the load generator.

Latency model: a request waits for a slot (concurrency limit, and optionally KV room for
prompt+max_tokens), then its first token comes after TTFT = ttft_base + ttft_per_token *
prompt_tokens, then one token every itl. With `slowdown` s, both times are multiplied by
1 + s*(running-1). `error_rate` of requests get `error_status` immediately.

It is a raw asyncio HTTP/1.1 server (keep-alive, chunked SSE) rather than FastAPI because
it must sustain 500+ streamed req/s on a 2-core box. Tokenizer: one token per UTF-8 byte.

Run: `quantpipe bench mock-server --port 8000 --itl-ms 10 --concurrency 8`
or `python -m quantpipe.runtime.bench.mock_server ...`; `spawn_mock(...)` for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, fields

import click

from quantpipe.runtime.bench.loop import run_async

WORDS = [" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", " and"]


@dataclass
class MockConfig:
    ttft_ms: float = 20.0  # fixed part of TTFT
    ttft_per_token_ms: float = 0.0  # prefill cost per prompt token
    itl_ms: float = 10.0
    concurrency: int = 0  # max requests decoding at once; 0 = unlimited
    kv_capacity_tokens: int = 0  # reserve prompt+max_tokens per request; 0 = unlimited
    slowdown: float = 0.0
    error_rate: float = 0.0
    error_status: int = 500
    eos_prob: float = 0.0  # per-token stop chance when ignore_eos is false
    seed: int = 0
    model: str = "mock-model"


class _Stats:
    def __init__(self) -> None:
        self.running = self.waiting = self.kv_reserved = 0
        self.success = self.errors = self.prompt_tokens = self.generation_tokens = 0


class MockServer:
    def __init__(self, cfg: MockConfig):
        self.cfg = cfg
        self.stats = _Stats()
        self.rng = random.Random(cfg.seed)
        self._queue: deque[tuple[int, asyncio.Future]] = deque()
        self._server: asyncio.base_events.Server | None = None

    # ---- admission ----------------------------------------------------------------
    def _fits(self, need: int) -> bool:
        c, s = self.cfg, self.stats
        if c.concurrency and s.running >= c.concurrency:
            return False
        # A request bigger than the whole cache still runs when alone (no deadlock).
        return not c.kv_capacity_tokens or s.kv_reserved + need <= c.kv_capacity_tokens or s.running == 0

    def _admit_waiting(self) -> None:
        while self._queue and self._fits(self._queue[0][0]):
            need, fut = self._queue.popleft()
            self.stats.waiting -= 1
            if fut.cancelled():
                continue
            self.stats.running += 1
            self.stats.kv_reserved += need
            fut.set_result(None)

    async def _acquire(self, need: int) -> None:
        if not self._queue and self._fits(need):
            self.stats.running += 1
            self.stats.kv_reserved += need
            return
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((need, fut))
        self.stats.waiting += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # admitted just before cancel: give back
                self._release(need)
            raise

    def _release(self, need: int) -> None:
        self.stats.running -= 1
        self.stats.kv_reserved -= need
        self._admit_waiting()

    def _factor(self) -> float:
        return 1.0 + self.cfg.slowdown * max(0, self.stats.running - 1)

    # ---- HTTP ---------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._conn, host, port, backlog=2048)
        return self._server.sockets[0].getsockname()[1]

    async def serve_forever(self) -> None:
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
                hdrs = {}
                for ln in lines[1:]:
                    if ":" in ln:
                        k, v = ln.split(":", 1)
                        hdrs[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(hdrs.get("content-length", 0) or 0))
                keep = await self._route(method, path.split("?")[0], body, writer)
                if not keep or hdrs.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _send(self, writer, status: int, body: bytes, ctype: str = "application/json") -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
        writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (status, reason.encode(), ctype.encode(), len(body), body))

    def _json(self, writer, status: int, obj) -> bool:
        self._send(writer, status, json.dumps(obj).encode())
        return True

    async def _route(self, method: str, path: str, body: bytes, writer) -> bool:
        if method == "GET" and path == "/health":
            self._send(writer, 200, b"")
            return True
        if method == "GET" and path == "/v1/models":
            return self._json(writer, 200, {"object": "list", "data": [
                {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "quantpipe"}]})
        if method == "GET" and path == "/metrics":
            self._send(writer, 200, self.metrics_text().encode(), "text/plain; version=0.0.4")
            return True
        if method != "POST" or path not in ("/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions"):
            return self._json(writer, 404, {"error": {"message": f"no route {method} {path}", "code": 404}})
        try:
            req = json.loads(body or b"{}")
            if not isinstance(req, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            return self._json(writer, 400, {"error": {"message": f"bad JSON: {e}", "code": 400}})
        if path == "/tokenize":
            text = req.get("prompt")
            if text is None and "messages" in req:
                text = "".join(str(m.get("content", "")) for m in req["messages"])
            toks = list(str(text or "").encode())
            return self._json(writer, 200, {"tokens": toks, "count": len(toks), "max_model_len": 1 << 20})
        if path == "/detokenize":
            return self._json(writer, 200, {"prompt": bytes(int(t) & 0xFF for t in req.get("tokens", [])).decode(
                "utf-8", "replace")})
        return await self._generate(req, chat=path.endswith("chat/completions"), writer=writer)

    # ---- generation ---------------------------------------------------------------
    @staticmethod
    def _prompt_tokens(req: dict, chat: bool) -> int:
        if chat:
            return sum(len(str(m.get("content", "")).encode()) for m in req.get("messages", []))
        p = req.get("prompt", "")
        if isinstance(p, list):
            p = p[0] if p and not isinstance(p[0], int) else p
            if isinstance(p, list):
                return len(p)  # token ids
        return len(str(p).encode())

    async def _generate(self, req: dict, chat: bool, writer) -> bool:
        c, s = self.cfg, self.stats
        if c.error_rate and self.rng.random() < c.error_rate:
            s.errors += 1
            return self._json(writer, c.error_status, {"error": {"message": "injected error", "code": c.error_status}})
        n_prompt = self._prompt_tokens(req, chat)
        max_tokens = int(req.get("max_completion_tokens") or req.get("max_tokens") or 16)
        n_out = max_tokens
        if not req.get("ignore_eos") and c.eos_prob > 0:
            n_out = 1
            while n_out < max_tokens and self.rng.random() >= c.eos_prob:
                n_out += 1
        stream = bool(req.get("stream"))
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        created = int(time.time())
        need = n_prompt + max_tokens
        loop = asyncio.get_running_loop()
        await self._acquire(need)
        try:
            t0 = loop.time()
            first = t0 + (c.ttft_ms + c.ttft_per_token_ms * n_prompt) / 1000 * self._factor()
            if stream:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
            obj = "chat.completion.chunk" if chat else "text_completion"
            head = f'{{"id":"{rid}","object":"{obj}","created":{created},"model":"{c.model}","choices":[{{"index":0,'
            if stream and chat:  # OpenAI sends the role first, with empty content
                self._chunk(writer, head + '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}')
            deadline = first
            text_parts = []
            for i in range(n_out):
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                word = WORDS[i % len(WORDS)]
                text_parts.append(word)
                if stream:
                    fin = '"length"' if (i == n_out - 1 and n_out == max_tokens) else ('"stop"' if i == n_out - 1 else "null")
                    body = f'"delta":{{"content":"{word}"}}' if chat else f'"text":"{word}"'
                    self._chunk(writer, head + body + f',"logprobs":null,"finish_reason":{fin}}}]}}')
                    if writer.transport.get_write_buffer_size() > 65536:
                        await writer.drain()
                # Absolute deadlines: jitter in one sleep does not accumulate into later tokens.
                deadline += c.itl_ms / 1000 * self._factor()
        finally:
            self._release(need)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        s.success += 1
        s.prompt_tokens += n_prompt
        s.generation_tokens += n_out
        finish = "length" if n_out == max_tokens else "stop"
        if stream:
            if include_usage:
                self._chunk(writer, f'{{"id":"{rid}","object":"{obj}","created":{created},"model":"{c.model}",'
                                    f'"choices":[],"usage":{json.dumps(usage)}}}')
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await writer.drain()
            return True
        text = "".join(text_parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        self._json(writer, 200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": c.model, "choices": [choice], "usage": usage})
        await writer.drain()
        return True

    @staticmethod
    def _chunk(writer, data: str) -> None:
        b = b"data: " + data.encode() + b"\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(b), b))

    def metrics_text(self) -> str:
        s, c = self.stats, self.cfg
        kv = s.kv_reserved / c.kv_capacity_tokens if c.kv_capacity_tokens else 0.0
        lab = f'{{model_name="{c.model}"}}'
        rows = [
            ("num_requests_running", "gauge", s.running), ("num_requests_waiting", "gauge", s.waiting),
            ("kv_cache_usage_perc", "gauge", round(kv, 6)), ("num_preemptions_total", "counter", 0),
            ("prompt_tokens_total", "counter", s.prompt_tokens),
            ("generation_tokens_total", "counter", s.generation_tokens),
            ("request_success_total", "counter", s.success), ("request_errors_total", "counter", s.errors),
        ]
        out = []
        for name, kind, v in rows:
            out += [f"# TYPE quantpipe:{name} {kind}", f"quantpipe:{name}{lab} {v}"]
        rss = _resident_bytes()
        if rss is not None:  # unprefixed, as prometheus_client's process collector names it
            out += ["# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {rss}"]
        return "\n".join(out) + "\n"


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux


# ---- running it -----------------------------------------------------------------------
def mock_options(f):
    """`--host`, `--port` and one option per MockConfig field."""
    for fld in reversed(fields(MockConfig)):
        f = click.option("--" + fld.name.replace("_", "-"), fld.name, type=type(fld.default), default=fld.default,
                         show_default=True)(f)
    f = click.option("--port", type=int, default=8000, show_default=True, help="0 picks a free port")(f)
    return click.option("--host", default="127.0.0.1", show_default=True)(f)


def serve(args: argparse.Namespace) -> int:
    cfg = MockConfig(**{f.name: getattr(args, f.name) for f in fields(MockConfig)})

    async def _main() -> None:
        server = MockServer(cfg)
        port = await server.start(args.host, args.port)
        print(f"quantpipe mock server listening on http://{args.host}:{port}", flush=True)
        await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        run_async(_main())
    return 0


@contextlib.contextmanager
def spawn_mock(timeout_s: float = 20.0, **cfg):
    """Run a mock server in a subprocess on a free 127.0.0.1 port; yields its base URL.

    A separate process keeps its timing independent of the load generator's event loop.
    """
    argv = [sys.executable, "-m", "quantpipe.runtime.bench.mock_server", "--port", "0"]
    for k, v in cfg.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "listening on" in line or proc.poll() is not None:
                break
        if "listening on" not in line:
            raise RuntimeError(f"mock server did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}")
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@click.command("mock-server", help=__doc__.split("\n")[0])
@mock_options
def main(**options) -> int:
    return serve(argparse.Namespace(**options))


if __name__ == "__main__":
    main()
