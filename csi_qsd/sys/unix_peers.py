"""Who holds a listening UNIX socket open: the kernel's socket table, read over sock_diag.

A vhost-user-blk export tells nobody whether a client is connected (QSD 10.0's
`query-block-exports` lists id, type, node and `shutting-down` only), so the
driver asks the kernel. A connection QSD accepted carries the listening
socket's address, so the sockets bound to the export's path in state
ESTABLISHED are its clients (a connection still waiting in the backlog is
not in the table: QSD serves one client at a time and has not taken it);
one whose peer has closed (both directions shut) is gone even if QSD has not
closed its end yet. Decided by netlink state
(NETLINK_SOCK_DIAG, `unix_diag`), never by a tool's output. The table is per
network namespace: the driver must share QSD's (the same pod, or the host's).
Never blocks on anything but the kernel.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
from pathlib import Path

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
UDIAG_SHOW_NAME = 0x1
UDIAG_SHOW_RQLEN = 0x10
UNIX_DIAG_NAME = 0
UNIX_DIAG_RQLEN = 4  # struct unix_diag_rqlen: for a listening socket, the connections waiting to be accepted
UNIX_DIAG_SHUTDOWN = 6
TCP_ESTABLISHED = 1
TCP_LISTEN = 10
SHUTDOWN_BOTH = 3  # RCV_SHUTDOWN | SEND_SHUTDOWN: what the peer's close leaves on our end

_NLMSG = struct.Struct("=IHHII")
_REQUEST = struct.Struct("=BBHIII8x")  # unix_diag_req: family, protocol, pad, states, ino, show, cookie
_MESSAGE = struct.Struct("=BBBBI8x")  # unix_diag_msg: family, type, state, pad, ino, cookie
_ATTR = struct.Struct("=HH")


@dataclasses.dataclass(frozen=True)
class SocketEnd:
    """One UNIX socket of the table: its address, state, what is shut on it, and its inode."""

    path: str
    state: int
    shutdown: int
    inode: int = 0
    queued: int = 0  # a listening socket's connections not yet accepted


@dataclasses.dataclass(frozen=True)
class Peers:
    """What the table says of one listening socket's path."""

    listening: bool
    clients: int
    waiting: int = 0  # connections in the listener's backlog, not yet accepted


def peers(path: Path) -> Peers:
    """Whether something listens on `path` (the address it was bound to: a rename of the file since does not
    change it), how many clients are connected, and how many wait to be accepted. Raises OSError."""
    name = os.fsdecode(path)
    ends = [end for end in table() if end.path == name]
    clients = [e for e in ends if e.state == TCP_ESTABLISHED and e.shutdown != SHUTDOWN_BOTH]
    listeners = [e for e in ends if e.state == TCP_LISTEN]
    return Peers(listening=bool(listeners), clients=len(clients), waiting=sum(e.queued for e in listeners))


def closed_by_peer() -> frozenset[int]:
    """Inodes of the bound sockets whose peer has closed (both directions shut). Raises OSError."""
    return frozenset(e.inode for e in table() if e.shutdown == SHUTDOWN_BOTH)


def table() -> list[SocketEnd]:
    """Every bound UNIX socket of this network namespace. Raises OSError."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as sock:
        body = _REQUEST.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_RQLEN)
        sock.sendall(_NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
                     + body)
        ends: list[SocketEnd] = []
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + _NLMSG.size <= len(data):
                length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, offset)
                if kind == NLMSG_DONE:
                    return ends
                if kind == NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, offset + _NLMSG.size)
                    raise OSError(-errno, f"sock_diag dump of UNIX sockets: {os.strerror(-errno)}")
                if kind == SOCK_DIAG_BY_FAMILY:
                    end = parse_message(data[offset + _NLMSG.size:offset + length])
                    if end is not None:
                        ends.append(end)
                offset += (length + 3) & ~3
            if not data:
                raise OSError("sock_diag: the kernel closed the dump early")


def parse_message(payload: bytes) -> SocketEnd | None:
    """One unix_diag_msg and its attributes; None for an unbound socket (no path)."""
    _family, _type, state, _pad, inode = _MESSAGE.unpack_from(payload)
    offset, path, shutdown, queued = _MESSAGE.size, "", 0, 0
    while offset + _ATTR.size <= len(payload):
        length, kind = _ATTR.unpack_from(payload, offset)
        if length < _ATTR.size:
            break
        value = payload[offset + _ATTR.size:offset + length]
        if kind == UNIX_DIAG_NAME and value[:1] not in (b"", b"\0"):  # "" unbound, NUL abstract
            path = os.fsdecode(value.split(b"\0", 1)[0])
        elif kind == UNIX_DIAG_SHUTDOWN and value:
            shutdown = value[0]
        elif kind == UNIX_DIAG_RQLEN and len(value) >= 4 and state == TCP_LISTEN:
            (queued,) = struct.unpack_from("=I", value)
        offset += (length + 3) & ~3
    return SocketEnd(path, state, shutdown, inode, queued) if path else None
