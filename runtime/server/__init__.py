"""OpenAI-compatible HTTP server around LLMEngine.

Layout (one concern per module):
  config.py        ServerConfig: every server/engine knob in one dataclass
  async_engine.py  the engine stepping in its own thread; asyncio streams per request
  protocol.py      request bodies (pydantic) with bounds on every field
  serving.py       request -> engine inputs, engine outputs -> OpenAI JSON / SSE chunks
  stream.py        stop-string hold-back for streaming
  gate.py          raw-ASGI front door: auth, draining, request rate, queue length
  limits.py        token-bucket rate limits, body-size limit
  request_log.py   the production request log: one JSON line per request, from a writer thread
  metrics.py       Prometheus metrics on a per-server registry
  errors.py        the OpenAI error shape
  app.py           FastAPI routes, auth, error handlers
  runner.py        uvicorn with graceful drain on SIGTERM
  cli.py           `quantpipe serve` / `python -m quantpipe.runtime.server`
"""
