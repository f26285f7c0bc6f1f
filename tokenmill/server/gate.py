"""The front door: auth, draining, request-rate and queue-length checks as raw ASGI.

These refusals are the ones a server under overload sends by the hundred, so they
run before routing, body reading and FastAPI's machinery: a refused request costs a
header scan and one small JSON write. What needs the body (token counts) is checked
later, in the handler.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from tokenmill.server.errors import error_body
from tokenmill.server.limits import RateLimiter, retry_after

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
DRAIN_PATHS = GENERATE_PATHS + ("/tokenize", "/detokenize")


@dataclass
class ServerState:
    draining: bool = False


class Gate:
    def __init__(self, app, *, config, state: ServerState, aengine, limiter: RateLimiter, metrics):
        self.app = app
        self.config = config
        self.state = state
        self.aengine = aengine
        self.limiter = limiter
        self.metrics = metrics
        self.keys = [k.encode() for k in config.api_keys]

    def _protected(self, path: str) -> bool:
        if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
            return True
        return self.config.protect_metrics and path in ("/metrics", "/health")

    def _key(self, scope) -> str | None:
        """The caller's API key (None: refused); its address when auth is off."""
        if not self.keys:
            client = scope.get("client")
            return client[0] if client else "anonymous"
        auth = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
                break
        scheme, _, token = auth.partition(b" ")
        token = token.strip()
        # Compare against every key (no early exit) so timing says nothing about which matched.
        ok = scheme.lower() == b"bearer" and sum(hmac.compare_digest(token, k) for k in self.keys) > 0
        return token.decode("latin-1") if ok else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        key = None
        if self._protected(path):
            key = self._key(scope)
            if key is None:
                self.metrics.rejected("auth")
                return await _send(send, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                   "invalid_api_key")
        if self.state.draining and path in DRAIN_PATHS:
            return await _send(send, 503, "the server is shutting down", "server_shutting_down",
                               {"Retry-After": "5", "Connection": "close"})
        if scope["method"] == "POST" and path in GENERATE_PATHS:
            wait = self.limiter.check_request(key or "anonymous")
            if wait > 0:
                self.metrics.rejected("rate_limit")
                return await _send(send, 429, f"rate limit exceeded (--rate-limit-rps {self.config.rate_limit_rps}); "
                                   f"retry in {wait:.2f}s", "rate_limit_exceeded", retry_after(wait))
            full = self.aengine.try_admit(0, self.config.max_queued_requests, None)
            if full:
                self.metrics.rejected("queue")
                return await _send(send, 429, f"server busy: {full}", "queue_full", retry_after(1.0))
        scope.setdefault("state", {})["rate_key"] = key or "anonymous"
        await self.app(scope, receive, send)


async def _send(send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
