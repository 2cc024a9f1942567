"""Serving a gRPC server on the UNIX socket of a `unix://` endpoint: the plugin's, the router's, the registrar's."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from csi_qsd.errors import StartupError
from csi_qsd.sys.endpoint import socket_path


@contextlib.asynccontextmanager
async def serving(server: grpc.aio.Server, endpoint: str) -> AsyncIterator[None]:
    """Start `server` on the endpoint's socket, replacing a stale one, open to the group (sidecars in the pod).

    The server is stopped and its socket removed on the way out. Raises
    StartupError when something other than a socket holds the path.
    """
    socket = socket_path(endpoint)
    socket.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(socket)
    server.add_insecure_port(endpoint)
    try:
        await server.start()
        os.chmod(socket, 0o660)
        yield
    finally:
        await server.stop(grace=5)
        socket.unlink(missing_ok=True)


def remove_stale(socket: Path) -> None:
    """Remove the socket a previous server left at `socket`; never a file or directory someone else put there.

    Raises StartupError for anything that is not a socket.
    """
    try:
        mode = os.lstat(socket).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{socket} exists and is not a socket: refusing to remove it")
    socket.unlink(missing_ok=True)
