"""Run the app under uvicorn, draining on SIGTERM/SIGINT.

uvicorn's own handling closes the listening socket at once (new clients get connection
refused) and re-raises the signal when done, which exits non-zero. We take over
handle_exit instead: the first signal flips the app into draining (new requests get
503, /health goes 503), in-flight requests get up to --drain-timeout to finish, the
rest are aborted, and then uvicorn shuts down normally and we exit 0. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from quantpipe.runtime.server.config import ServerConfig

log = logging.getLogger("quantpipe.runtime.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app, drain_timeout: float):
        super().__init__(config)
        self.tm_app = app
        self.drain_timeout = drain_timeout
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:  # called in the signal handler
        if self._draining or self._loop is None:
            self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        state, aengine = self.tm_app.state.server_state, self.tm_app.state.aengine
        state.draining = True
        log.info("draining: %d requests in flight, up to %.0fs", aengine.num_inflight, self.drain_timeout)
        end = time.monotonic() + self.drain_timeout
        while aengine.num_inflight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if aengine.num_inflight:
            n = aengine.abort_all("the server shut down before this request finished (--drain-timeout)")
            self.tm_app.state.metrics.aborted.inc(n)
            log.warning("drain timeout: aborted %d requests", n)
            await asyncio.sleep(0.2)  # let their handlers send the error
        self.should_exit = True


def serve(app, config: ServerConfig) -> int:
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
        timeout_graceful_shutdown=5, timeout_keep_alive=5,
    )
    server = DrainingServer(uv_config, app, config.drain_timeout)
    server.run()
    return 0 if server.started else 1


__all__ = ["DrainingServer", "serve"]
