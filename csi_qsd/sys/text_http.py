"""A plain-text HTTP/1.1 endpoint: a few GET paths, one request per connection.

What Prometheus (/metrics) and kubelet's httpGet probes (/healthz) need and
nothing more: no keep-alive, no request bodies, no TLS, so the driver and
its kubelet-facing helpers carry no web framework. A route is a coroutine
that answers (status, body); it runs for each GET or HEAD of its path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus

Route = Callable[[], Awaitable[tuple[HTTPStatus, bytes]]]
TEXT = "text/plain; charset=utf-8"
# A client that sends no complete request head within this is dropped.
REQUEST_TIMEOUT = 10.0


def listen_address(text: str) -> tuple[str | None, int]:
    """(host, port) of `host:port`, `[v6]:port` or `:port`; host None for all interfaces. Raises ValueError."""
    host, colon, port = text.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT or :PORT, got {text!r}")
    return host.strip("[]") or None, int(port)


async def start(address: str, routes: Mapping[str, Route], content_type: str = TEXT) -> asyncio.Server:
    """Serve `routes` (path → route) on `address` (see listen_address) until the caller closes the server.

    Raises ValueError for a bad address and OSError when it cannot listen.
    """
    host, port = listen_address(address)
    return await asyncio.start_server(lambda r, w: _answer(routes, content_type, r, w), host, port)


async def _answer(routes: Mapping[str, Route], content_type: str, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    try:
        request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
        parts = request.split(b"\r\n", 1)[0].split(b" ")
        method, path = (parts[0], parts[1].split(b"?")[0]) if len(parts) >= 2 else (b"", b"")
        route = routes.get(path.decode("latin-1"))
        if method not in (b"GET", b"HEAD"):
            status, body = HTTPStatus.METHOD_NOT_ALLOWED, b"method not allowed\n"
        elif route is None:
            status, body = HTTPStatus.NOT_FOUND, b"not found\n"
        else:
            status, body = await route()
        head = (f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head if method == b"HEAD" else head + body)
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()
