"""The front door: auth, draining, request-rate and queue-length checks as raw ASGI.

These refusals are the ones a server under overload sends by the hundred, so they
run before routing, body reading and FastAPI's machinery: a refused request costs a
header scan and one small JSON write. What needs the body (token counts) is checked
later, in the handler.
"""

from __future__ import annotations

import hmac
import uuid
from dataclasses import dataclass

from quantpipe.runtime.server.errors import APIError, queue_full, rate_limited, send_error
from quantpipe.runtime.server.limits import RateLimiter

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
DRAIN_PATHS = GENERATE_PATHS + ("/tokenize", "/detokenize")


@dataclass
class ServerState:
    draining: bool = False


class Gate:
    def __init__(self, app, *, config, state: ServerState, aengine, limiter: RateLimiter, metrics,
                 on_refused=None):
        self.app = app
        self.on_refused = on_refused  # (id, path, error): logs a refused generation request
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
        err = self._refusal(scope)
        if err is not None:
            if err.reason:
                self.metrics.rejected(err.reason)
            if self.on_refused is not None and scope["path"] in GENERATE_PATHS:
                rid = f"req-{uuid.uuid4().hex}"
                err.headers = {**(err.headers or {}), "X-Request-Id": rid}
                # The body is never read here (refusals must stay cheap), so the record has none.
                self.on_refused(rid, scope["path"], err)
            return await send_error(send, err)
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        """Why this request is refused at the door, or None (then its rate key is in scope)."""
        path = scope["path"]
        key = None
        if self._protected(path):
            key = self._key(scope)
            if key is None:
                return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key", reason="auth")
        if self.state.draining and path in DRAIN_PATHS:
            return APIError(503, "the server is shutting down", code="server_shutting_down",
                            headers={"Retry-After": "5", "Connection": "close"})
        if scope["method"] == "POST" and path in GENERATE_PATHS:
            wait = self.limiter.check_request(key or "anonymous")
            if wait > 0:
                return rate_limited(wait, f"--rate-limit-rps {self.config.rate_limit_rps}")
            full = self.aengine.try_admit(0, self.config.max_queued_requests, None)
            if full:
                return queue_full(full)
        scope.setdefault("state", {})["rate_key"] = key or "anonymous"
        return None
