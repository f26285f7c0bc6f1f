"""FastAPI app: routes, admission, error handlers.

Order of checks for a generation request, cheapest first, so refused requests cost
no compute: auth -> draining -> per-key request rate -> queue length (all in gate.py,
before routing) -> body size -> parse and validate (tokenizes) -> per-key token rate
and queued tokens (here) -> hand to the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantpipe.runtime.llm_engine import LLMEngine
from quantpipe.runtime.outputs import RequestOutput
from quantpipe.runtime.server.async_engine import AsyncEngine, EngineError, EngineRequest, RequestStream
from quantpipe.runtime.server.config import ServerConfig
from quantpipe.runtime.server.errors import APIError, error_body, error_response, queue_full, rate_limited
from quantpipe.runtime.server.gate import Gate, ServerState
from quantpipe.runtime.server.limits import BodySizeLimit, RateLimiter
from quantpipe.runtime.server.metrics import ServerMetrics
from quantpipe.runtime.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from quantpipe.runtime.server.request_log import RequestLog, log_record
from quantpipe.runtime.server.serving import Prepared, Preparer, Responder, bad

log = logging.getLogger("quantpipe.runtime.server")


_STATUS = {None: "ok", "disconnect": "aborted", "timeout": "timeout", "error": "error"}


@dataclass
class Flight:
    """One admitted request's exit: finished, or aborted exactly once (counted in metrics),
    and logged exactly once to the request log."""

    request_id: str
    aengine: AsyncEngine
    metrics: ServerMetrics
    on_close: Callable[[str, RequestOutput | None, APIError | None], None] | None = None
    last: RequestOutput | None = None  # the newest output seen
    done: bool = False

    def close(self, why: str | None = None, error: APIError | None = None) -> None:
        """why: None (ended normally), "disconnect", "timeout" or "error" (with `error`)."""
        if self.done:
            return
        self.done = True
        if why in ("disconnect", "timeout") and self.aengine.abort(self.request_id):
            (self.metrics.timeouts if why == "timeout" else self.metrics.aborted).inc()
        if self.on_close is not None:
            self.on_close(_STATUS[why], self.last, error)


class SSEResponse(StreamingResponse):
    """A stream whose request is aborted however the response ends (disconnect included)."""

    def __init__(self, content, flight: Flight):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  "X-Request-Id": flight.request_id})
        self.flight = flight

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.close("disconnect")  # no-op when it already finished


def _sse(data: dict | str) -> str:
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {body}\n\n"


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the first pydantic error; param is the top-level field."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [x for x in e.get("loc", ()) if x != "body"]
    param = str(loc[0]) if loc and isinstance(loc[0], str) else None
    if e.get("type") == "json_invalid":
        return f"request body is not valid JSON: {e.get('msg')}", None
    if e.get("type") == "missing":
        return f"{param} is required", param
    where = ".".join(str(x) for x in loc[:1] + [x for x in loc[1:] if isinstance(x, int)])
    msg = str(e.get("msg")).removeprefix("Value error, ")  # our own validators' messages
    return f"{where or 'body'}: {msg}", param


async def read_json(request: Request) -> dict:
    body = await request.body()
    try:
        obj = json.loads(body)
    except UnicodeDecodeError:
        raise bad("request body is not valid UTF-8") from None
    except (ValueError, RecursionError) as e:
        raise bad(f"request body is not valid JSON: {e}"[:300]) from None
    if not isinstance(obj, dict):
        raise bad("request body must be a JSON object")
    return obj


def parse(model: type[BaseModel], obj: dict):
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        raise bad(message, param) from None


def create_app(engine: LLMEngine, config: ServerConfig, model_names: list[str]) -> FastAPI:
    """The app around an already-loaded engine; model_names[0] is the served name."""
    metrics = ServerMetrics(model_names[0])
    aengine = AsyncEngine(engine, metrics)
    preparer = Preparer(engine, model_names)
    limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_tpm)
    state = ServerState()
    request_log = None
    if config.request_log is not None:  # opened now: a log that cannot be written refuses start-up
        request_log = RequestLog(config.request_log, on_written=metrics.request_log_lines.inc,
                                 on_dropped=metrics.request_log_dropped.inc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            aengine.stop()
            if request_log is not None:
                request_log.close()

    app = FastAPI(title="quantpipe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.aengine = aengine
    app.state.metrics = metrics
    app.state.server_state = state
    # Added last = outermost: the gate refuses before the body is even read.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes,
                       on_reject=lambda: metrics.rejected("bad_request"))
    app.add_middleware(Gate, config=config, state=state, aengine=aengine, limiter=limiter, metrics=metrics,
                       on_refused=request_log and (lambda rid, path, err: request_log.write(log_record(
                           rid, time.time(), path, model_names[0], "rejected" if err.status in (429, 503)
                           else "error", None, None, err, None, None, 0.0))))

    # -- errors ---------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        if exc.reason:
            metrics.rejected(exc.reason)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        metrics.rejected("bad_request")
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")

    # -- generation -----------------------------------------------------------------------

    async def generate(request: Request, model_cls, prepare, prefix: str) -> Response:
        arrival = engine.clock()
        started = time.monotonic()
        created = time.time()
        rid = f"{prefix}-{uuid.uuid4().hex}"
        key = request.state.rate_key  # set by the gate, which already checked auth, rps, queue length
        body: dict | None = None
        preps: list[Prepared] = []

        def log_request(sid: str, sub_body: dict | None, prep: Prepared | None, status: str,
                        out: RequestOutput | None, error: APIError | None, responder: Responder | None = None) -> None:
            if request_log is not None:
                request_log.write(log_record(
                    sid, created, request.url.path, model_names[0], status, sub_body, out, error, prep,
                    responder, time.monotonic() - started))

        def sub(i: int) -> tuple[str, dict | None]:
            """The engine request id and the request-log body of the i-th prompt: a request with
            several prompts is logged as one line per prompt, each with its own prompt."""
            if len(preps) == 1:
                return rid, body
            return f"{rid}-{i}", {**body, "prompt": body["prompt"][i]}

        try:
            body = await read_json(request)
            preps = await prepare(parse(model_cls, body))
            cost = sum(p.cost_tokens for p in preps)
            if len(preps) > 1:  # a batch the queue could never hold is the request's fault: not a 429 to retry
                if config.max_queued_requests is not None and len(preps) > config.max_queued_requests:
                    raise bad(f"prompt: {len(preps)} prompts, more than the queue takes at once "
                              f"(--max-queued-requests {config.max_queued_requests}); send fewer per request",
                              "prompt")
                if config.max_queued_tokens is not None and cost > config.max_queued_tokens:
                    raise bad(f"prompt: these prompts cost {cost} tokens with their max_tokens, more than the "
                              f"queue takes at once (--max-queued-tokens {config.max_queued_tokens}); send "
                              f"fewer per request", "prompt")
            # Queue first: a request the queue refuses must not spend the caller's token budget.
            # No await from here to aengine.add(), so the checks and the reservation are atomic.
            full = aengine.try_admit(cost, config.max_queued_requests, config.max_queued_tokens, len(preps))
            if full:
                raise queue_full(full)
            wait = limiter.check_tokens(key, cost)
            if wait > 0:
                raise rate_limited(wait, f"--rate-limit-tpm {config.rate_limit_tpm}")
        except APIError as e:
            e.headers = {**(e.headers or {}), "X-Request-Id": rid}
            status = "rejected" if e.status in (429, 503) else "error"
            for i, prep in enumerate(preps or [None]):
                sid, sub_body = sub(i) if preps else (rid, body)
                log_request(sid, sub_body, prep, status, None, e)
            raise
        subs = []
        for i, prep in enumerate(preps):
            sid, sub_body = sub(i)
            stream = aengine.add(EngineRequest(sid, prep.prompt_ids, prep.params, arrival, prep.priority,
                                               prep.cost_tokens))
            responder = Responder(prep, rid, engine.tokenizer)
            flight = Flight(sid, aengine, metrics, on_close=lambda status, out, err, sid=sid, b=sub_body, p=prep,
                            r=responder: log_request(sid, b, p, status, out, err, r))
            subs.append((flight, stream, responder))
        deadline = started + config.request_timeout if config.request_timeout else None
        if preps[0].stream:  # one prompt (checked when prepared)
            flight, stream, responder = subs[0]
            return SSEResponse(stream_body(flight, stream, responder, deadline), flight)
        try:
            return await whole_body(request, rid, subs, deadline)
        finally:
            for flight, _, _ in subs:
                flight.close("disconnect")  # handler cancelled (shutdown): no-op when it finished

    async def next_output(stream: RequestStream, deadline: float | None):
        if deadline is None:
            return await stream.next()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return await stream.next(left)

    def timeout_error() -> APIError:
        return APIError(408, f"request ran past --request-timeout {config.request_timeout}s and was aborted",
                        code="request_timeout")

    async def stream_body(flight: Flight, stream: RequestStream, responder: Responder, deadline):
        try:
            for chunk in responder.first_chunks():
                yield _sse(chunk)
            while True:
                out = flight.last = await next_output(stream, deadline)
                for chunk in responder.chunks(out):
                    yield _sse(chunk)
                if out.finished:
                    break
            flight.close()
        except TimeoutError:
            err = timeout_error()
            flight.close("timeout", err)
            yield _sse(err.body())
        except EngineError as e:
            flight.close("error", APIError(e.status, str(e)))
            yield _sse(error_body(e.status, str(e)))
        finally:
            flight.close("disconnect")  # cancelled by a disconnect: abort now, not at GC
        yield _sse("[DONE]")

    async def whole_body(request: Request, rid: str, subs: list, deadline) -> Response:
        """The whole response once every prompt's request finished; a disconnect aborts them all,
        and one that fails (timeout, engine error) fails the response and aborts the others."""
        async def collect(flight: Flight, stream: RequestStream):
            while True:
                out = flight.last = await next_output(stream, deadline)
                if out.finished:
                    return out

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(collect(flight, stream)) for flight, stream, _ in subs]
        for t in tasks:  # several can fail together (one deadline, one engine): each failure is read
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        watch = asyncio.ensure_future(disconnected())
        pending = set(tasks)
        try:
            while pending:
                done, _ = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
                if watch in done or any(not t.cancelled() and t.exception() is not None for t in done):
                    break
        finally:
            watch.cancel()
            for t in tasks:
                if not t.done():
                    t.cancel()
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is None and not all(t.done() and not t.cancelled() for t in tasks):
            for flight, _, _ in subs:
                flight.close("disconnect")
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        if failed is not None:
            exc = failed.exception()
            if isinstance(exc, TimeoutError):
                why, err = "timeout", timeout_error()
                err.headers = {"X-Request-Id": rid}
            elif isinstance(exc, EngineError):
                why, err = "error", APIError(exc.status, str(exc), reason="bad_request" if exc.status == 400
                                             else None, headers={"X-Request-Id": rid})
            else:
                raise exc
            for each, _, _ in subs:  # the failed one, and the rest of its request with it
                each.close(why, err)
            raise err from None
        bodies = []
        for task, (flight, _, responder) in zip(tasks, subs):
            bodies.append(responder.response(task.result()))
            flight.close()
        body = bodies[0]
        if len(bodies) > 1:  # one response for all the prompts, choices in their order
            body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
            body["usage"] = {k: sum(b["usage"][k] for b in bodies) for k in body["usage"]}
        return JSONResponse(body, headers={"X-Request-Id": rid})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest, preparer.completion, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatRequest, preparer.chat, "chatcmpl")

    # -- everything else ------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{
            "id": model_names[0], "object": "model", "created": 0, "owned_by": "quantpipe",
            "root": model_names[0], "max_model_len": engine.max_model_len,
        }]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(TokenizeRequest, await read_json(request))
        preparer.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad("send exactly one of prompt or messages", "prompt")
        text = req.prompt if req.prompt is not None else preparer.chat_text(req.messages, req.add_generation_prompt)
        tokens = await preparer.encode(text, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        # vLLM's endpoint: what a client needs to tokenize as the server does (lm-eval's
        # `tokenizer_backend=remote` reads it, then tokenizes through /tokenize).
        if engine.tokenizer is None:
            return error_response(404, "this model has no tokenizer")
        return preparer.tokenizer_info()

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await read_json(request))
        preparer.check_model(req.model)
        preparer.check_ids(req.tokens, "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/health")
    async def health(request: Request):
        # Reads two flags: never waits on the engine thread or a step.
        if state.draining or not aengine.alive:
            return error_response(503, "shutting down" if state.draining else "engine thread stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
