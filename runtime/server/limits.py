"""Rate limits (per-key token buckets) and the request body-size limit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from quantpipe.runtime.server.errors import APIError, send_error


@dataclass
class TokenBucket:
    """`rate` units per second, bursts up to `capacity`.

    A cost above the capacity (one request bigger than a whole minute of --rate-limit-tpm)
    passes when the bucket is full and leaves it in debt, instead of never passing.
    """

    rate: float
    capacity: float
    tokens: float
    stamp: float

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, cost: float, now: float) -> float:
        """Seconds until `cost` can be taken (0: now)."""
        self.refill(now)
        need = min(cost, self.capacity)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate

    def take(self, cost: float) -> None:
        self.tokens -= cost


class RateLimiter:
    """--rate-limit-rps and --rate-limit-tpm, one pair of buckets per API key (or client)."""

    MAX_KEYS = 10_000  # without auth, keys are client addresses: keep the table bounded

    def __init__(self, rps: float | None, tpm: float | None, clock: Callable[[], float] = time.monotonic):
        self.rps, self.tpm, self.clock = rps, tpm, clock
        self._buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}

    @property
    def enabled(self) -> bool:
        return self.rps is not None or self.tpm is not None

    def _get(self, key: str, now: float):
        pair = self._buckets.get(key)
        if pair is None:
            if len(self._buckets) >= self.MAX_KEYS:
                self._buckets.clear()  # crude but safe: everyone starts with a full bucket
            rb = TokenBucket(self.rps, max(1.0, self.rps), max(1.0, self.rps), now) if self.rps else None
            tb = TokenBucket(self.tpm / 60.0, self.tpm, self.tpm, now) if self.tpm else None
            pair = self._buckets[key] = (rb, tb)
        return pair

    def check_request(self, key: str) -> float:
        """Take one request from the rps bucket; >0: refused, retry after that many seconds."""
        if self.rps is None:
            return 0.0
        now = self.clock()
        rb, _ = self._get(key, now)
        wait = rb.wait_for(1, now)
        if wait == 0:
            rb.take(1)
        return wait

    def check_tokens(self, key: str, cost: int) -> float:
        """Take `cost` tokens from the tpm bucket; >0: refused, retry after that many seconds."""
        if self.tpm is None:
            return 0.0
        now = self.clock()
        _, tb = self._get(key, now)
        wait = tb.wait_for(cost, now)
        if wait == 0:
            tb.take(cost)
        return wait


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413, before parsing.

    It buffers the body (at most max_bytes) and replays it, so it also catches chunked
    uploads without a Content-Length. After the body, `receive` passes through, so
    handlers still see http.disconnect.
    """

    def __init__(self, app, max_bytes: int, on_reject: Callable[[], None] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def _reject(self, send) -> None:
        if self.on_reject:
            self.on_reject()
        await send_error(send, APIError(413, f"request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
                                        headers={"Connection": "close"}))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    return await self._reject(send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnected while uploading
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._reject(send)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
