"""One vhost-user exchange with a new export, so QSD has set its device up before anything can resize it.

Measured on QSD 10.0.13: ``block_resize`` under a vhost-user-blk export that
no client has ever connected to kills QSD (SIGSEGV, every volume of the node
with it): the export tells a device that was never initialised about the new
size. QSD initialises the device when it accepts a connection and keeps it
set up after the client leaves, so one short connection that asks for the
features (``VHOST_USER_GET_FEATURES``) and sees the answer makes every later
resize safe, with or without a guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from pathlib import Path

log = logging.getLogger(__name__)

GET_FEATURES = 1
VERSION_1 = 0x1
REPLY = 0x4
HEADER = struct.Struct("<III")  # request, flags, payload size


async def greet(socket: Path, timeout: float = 2.0) -> bool:
    """Ask the export at `socket` for its features; True once it answered.

    False when it did not answer in time: a guest that reconnected first
    holds the export (QSD serves one client at a time), and its connection
    set the device up already.
    """
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(str(socket))
    except (OSError, TimeoutError) as exc:
        log.warning("event=vhost_greeting_failed socket=%s error=%s", socket, exc)
        return False
    try:
        async with asyncio.timeout(timeout):
            writer.write(HEADER.pack(GET_FEATURES, VERSION_1, 0))
            await writer.drain()
            request, flags, size = HEADER.unpack(await reader.readexactly(HEADER.size))
            await reader.readexactly(size)
        return request == GET_FEATURES and bool(flags & REPLY)
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        log.info("event=vhost_greeting_unanswered socket=%s error=%r", socket, exc)
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
