"""The OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import math

from fastapi.responses import JSONResponse

# HTTP status -> OpenAI error type, as OpenAI and vLLM name them.
_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a handler; turned into the OpenAI error JSON by the app."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        # Label for quantpipe:request_rejected_total (queue, rate_limit, auth, bad_request).
        self.reason = reason

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    etype = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code if code else status}}


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def queue_full(detail: str) -> APIError:
    return APIError(429, f"server busy: {detail}", code="queue_full", headers=retry_after(1.0), reason="queue")


def rate_limited(wait: float, limit: str) -> APIError:
    """`limit` names the flag that refused, e.g. "--rate-limit-rps 5"."""
    return APIError(429, f"rate limit exceeded ({limit}); retry in {wait:.2f}s", code="rate_limit_exceeded",
                    headers=retry_after(wait), reason="rate_limit")


async def send_error(send, err: APIError) -> None:
    """`err` as a raw ASGI response, for middleware that answers before any routing."""
    body = json.dumps(err.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def param_of(message: str) -> str | None:
    """The parameter a SamplingParams/engine ValueError names: its first word, when it looks like one."""
    first = message.split(" ", 1)[0].split("=", 1)[0]
    known = {"n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "min_tokens", "logprobs",
             "seed", "stop", "stop_token_ids", "prompt", "messages"}
    return first if first in known else None
