"""The bench's HTTP/1.1 client: chunked framing however the bytes are split, keep-alive reuse,
and clear errors for broken bodies. The server is a raw asyncio socket on 127.0.0.1 that
writes exactly the bytes each test gives it, in the pieces it gives them."""

import asyncio

import pytest

from quantpipe.runtime.bench.http import HTTPClient, HTTPError

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes, ext: str = "") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), ext.encode(), data)


SSE = [b"data: {\"a\": 1}\n\n", b"data: {\"a\": 2}\n\n", b"data: [DONE]\n\n"]
BODY = _chunk(SSE[0]) + _chunk(SSE[1], ";name=value") + _chunk(SSE[2]) + b"0\r\n\r\n"
EXPECTED = [b"data: {\"a\": 1}", b"", b"data: {\"a\": 2}", b"", b"data: [DONE]", b""]


def _serve(responses: list[list[bytes]]):
    """Start a server answering successive requests (on any connection) with `responses`."""
    queue = list(responses)
    conns = []

    async def handle(reader, writer):
        conns.append(writer)
        while queue:
            while (await reader.readline()) not in (b"\r\n", b""):
                pass  # request head; bodies in these tests are empty
            if reader.at_eof():
                break
            for piece in queue.pop(0):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)  # separate TCP reads on the client side
        writer.close()

    return handle, conns


async def _lines(responses, requests=1):
    handle, conns = _serve(responses)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HTTPClient(f"http://127.0.0.1:{port}")
    try:
        out = []
        for _ in range(requests):
            resp = await client.get("/")
            out.append([ln async for ln in resp.iter_lines()])
        return out, len(conns), client
    finally:
        await client.aclose()
        server.close()


@pytest.mark.parametrize("split", ["whole", "per_byte", "per_chunk", "mid_crlf"])
def test_chunked_sse_lines_whatever_the_split(split):
    body = BODY
    pieces = {"whole": [body],
              "per_byte": [body[i:i + 1] for i in range(len(body))],
              "per_chunk": [_chunk(s) for s in SSE] + [b"0\r\n\r\n"],
              "mid_crlf": [body[:10], body[10:len(body) - 3], body[len(body) - 3:]]}[split]
    out, _, _ = asyncio.run(_lines([[HEAD] + pieces]))
    assert out == [EXPECTED]


def test_trailers_and_keep_alive_reuse():
    trailer_body = _chunk(SSE[0]) + b"0\r\nX-Trailer: 1\r\n\r\n"
    out, nconns, _ = asyncio.run(_lines([[HEAD, trailer_body], [HEAD, BODY]], requests=2))
    assert out == [EXPECTED[:2], EXPECTED]
    assert nconns == 1  # the second request reused the first connection


@pytest.mark.parametrize("body, message", [
    (b"zz\r\nabc\r\n", "size line"),
    (b"-3\r\nabc\r\n", "size line"),
    (b"3\r\nabcXY0\r\n\r\n", "no CRLF after a chunk"),
    (_chunk(SSE[0]) + b"5\r\nab", "connection closed mid-body"),
])
def test_broken_chunked_bodies_raise_clear_errors(body, message):
    with pytest.raises(HTTPError, match=message):
        asyncio.run(_lines([[HEAD, body]]))
