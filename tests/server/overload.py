"""A burst of requests written at once on pre-opened connections, with /health polled
meanwhile: the overload test's probe and benchmarks/bench_overload.py's."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

import httpx


async def _raw_post(reader, writer, path: str, body: dict) -> tuple[int, dict, dict, float]:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    writer.write(head + data)
    raw = await reader.read(-1)  # Connection: close -> EOF ends the response
    elapsed = time.perf_counter() - t0
    writer.close()
    header_blob, _, payload = raw.partition(b"\r\n\r\n")
    lines = header_blob.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, json.loads(payload), elapsed


def burst(server, body, n: int = 200) -> tuple[list, list[float]]:
    """n requests written at once on pre-opened connections; /health polled meanwhile."""
    health_lat: list[float] = []
    stop = threading.Event()

    def poll_health():  # own thread and keep-alive connection: measures the server, not our loop
        with httpx.Client(base_url=server.url, timeout=5) as c:
            while not stop.is_set() and len(health_lat) < 2000:
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                health_lat.append(time.perf_counter() - t0)
                time.sleep(0.02)

    async def send_all():
        conns = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", server.port) for _ in range(n)))
        return await asyncio.wait_for(
            asyncio.gather(*(_raw_post(r, w, "/v1/completions", body) for r, w in conns)), 300)

    poller = threading.Thread(target=poll_health, daemon=True)
    # This process has loaded models and data by the time the suite gets here: a full
    # collection of its heap would pause the client for tens of ms and be counted as server
    # latency. Collect now and keep the collector off while measuring.
    gc.collect()
    gc.disable()
    poller.start()
    try:
        results = asyncio.run(send_all())
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join(10)
        gc.enable()
    return results, health_lat
