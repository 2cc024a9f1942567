"""Serving a gRPC server on the UNIX socket of a `unix://` endpoint: the node plugin's and the router's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import grpc

from csi_qsd.sys.endpoint import socket_path


@contextlib.asynccontextmanager
async def serving(server: grpc.aio.Server, endpoint: str) -> AsyncIterator[None]:
    """Start `server` on the endpoint's socket, replacing a stale one, open to the group (sidecars in the pod).

    The server is stopped and its socket removed on the way out.
    """
    socket = socket_path(endpoint)
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)
    server.add_insecure_port(endpoint)
    try:
        await server.start()
        os.chmod(socket, 0o660)
        yield
    finally:
        await server.stop(grace=5)
        socket.unlink(missing_ok=True)
