"""Whether the vhost-user clients of a process (QSD) set up their back-end channel, read from its descriptors.

A vhost-user back end tells a client of a config change (a disk that grew)
over the back-end request channel: a socket pair the client makes and hands
over (`VHOST_USER_SET_BACKEND_REQ_FD`) right after it connects. A guest's
QEMU sets one up; libblkio's `virtio-blk-vhost-user` driver does not, and
QSD 10.0.13 writes the config change to the missing channel anyway and dies
(SIGSEGV after "vu_panic: Error while writing: Bad file descriptor"), taking
every volume it serves with it. QSD's QMP does not say which client has one,
so this asks the kernel, through QSD's own descriptors:

* a connection QSD accepted on an export's socket carries that socket's
  path as its own name; its peer is the client;
* a back-end channel is QSD's end of a socket pair: unnamed, connected to
  an unnamed end;
* both carry the process that made the other end (SO_PEERPIDFD: a pidfd,
  the same pidfs inode for the same process in any PID namespace; before
  Linux 6.9 pidfds share one inode, so the peer's PID from SO_PEERCRED, 0
  where the process is not visible from here).

A process with fewer channels than connections to QSD's exports has a
client without one. Where a peer cannot be told apart (no SO_PEERPIDFD, a
PID not visible), every client counts as one process: safe, and strict
only while a client without a channel is connected to another export.

QSD's descriptors are copied with pidfd_getfd (Linux 5.6; the caller needs
ptrace access to QSD: the same PID namespace and CAP_SYS_PTRACE) and closed
at once; nothing is read or written on them. Linux only.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

SYS_PIDFD_GETFD = 438  # the same number on every architecture Linux gives it
SO_PEERPIDFD = 77
_UCRED_SIZE = 12  # struct ucred: pid, uid, gid
_UNKNOWN = "?"

_libc = ctypes.CDLL(None, use_errno=True)


@dataclasses.dataclass(frozen=True)
class End:
    """One connected UNIX stream socket a process holds: its name, its peer's name, who made the peer."""

    name: str
    peer_name: str
    peer: str  # an identity of the peer's process ("" when it cannot be told)
    peer_pid: int  # as this PID namespace sees it (0: not visible)

    @property
    def channel(self) -> bool:
        """An end of a socket pair (both ends unnamed): what a back-end channel is."""
        return not self.name and not self.peer_name


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The clients connected to one export's socket, and those that lack a back-end channel."""

    clients: int
    without_channel: int
    pids: tuple[int, ...] = ()  # of the clients without one, where visible
    exact: bool = True  # False: peers could not be told apart, every client counted as one process


def judge(ends: list[End], path: str, is_export: Callable[[str], bool], own: str = "") -> Verdict:
    """Which clients of `path` lack a back-end channel, from the ends a process holds (pure logic).

    `is_export` tells the names of export sockets (vhost-user clients) from others (QMP); `own` is the
    holder's identity, whose own socket pairs are no back-end channels.
    """
    clients = [e for e in ends if e.name and is_export(e.name)]
    channels = [e for e in ends if e.channel and not (own and e.peer == own)]
    exact = all(e.peer for e in clients + channels)
    key: Callable[[End], str] = (lambda e: e.peer) if exact else (lambda e: _UNKNOWN)
    connections = collections.Counter(key(e) for e in clients)
    paired = collections.Counter(key(e) for e in channels)
    short = {who for who, count in connections.items() if paired[who] < count}
    mine = [e for e in clients if e.name == path]
    lacking = [e for e in mine if key(e) in short]
    return Verdict(len(mine), len(lacking), tuple(sorted({e.peer_pid for e in lacking if e.peer_pid})), exact)


def inspect(pid: int, path: Path, is_export: Callable[[str], bool], shut: frozenset[int] = frozenset()) -> Verdict:
    """`judge` over the connected UNIX sockets process `pid` holds; sockets whose inode is in `shut` (their
    peer has closed) are skipped. Raises OSError (no such process, no ptrace access, Linux too old)."""
    pidfd = os.pidfd_open(pid)
    try:
        own = _identity_of_pidfd(pidfd)
        pidfs = _pidfs()
        ends = list(_ends(pid, pidfd, pidfs, shut))
    finally:
        os.close(pidfd)
    return judge(ends, os.fsdecode(path), is_export, own if pidfs else "")


def _ends(pid: int, pidfd: int, pidfs: bool, shut: frozenset[int]) -> Iterator[End]:
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue  # closed meanwhile
        if not link.startswith("socket:[") or int(link[8:-1]) in shut:
            continue
        try:
            fd = _pidfd_getfd(pidfd, int(entry))
        except OSError as error:
            if error.errno == errno.EBADF:
                continue  # closed meanwhile
            raise
        with contextlib.closing(socket.socket(fileno=fd)) as sock:
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer_name = _name(sock.getpeername())
            except OSError:
                continue  # a listener, or not connected
            yield End(_name(sock.getsockname()), peer_name, _peer(sock, pidfs), _peer_pid(sock))


def _name(address: object) -> str:
    """A UNIX socket's path ('' unnamed); an abstract name (bytes from Python) as '@…'."""
    if isinstance(address, bytes):
        return "@" + address[1:].decode(errors="replace") if address else ""
    return str(address)


def _peer(sock: socket.socket, pidfs: bool) -> str:
    if pidfs:
        try:
            peer = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError as error:
            if error.errno != errno.ENOPROTOOPT:
                return ""  # the peer is gone (ESRCH): cannot be told
        else:
            try:
                return _identity_of_pidfd(peer)
            finally:
                os.close(peer)
    pid = _peer_pid(sock)
    return f"pid:{pid}" if pid else ""


def _peer_pid(sock: socket.socket) -> int:
    return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED_SIZE)[:4], "little",
                          signed=True)


def _identity_of_pidfd(pidfd: int) -> str:
    st = os.fstat(pidfd)
    return f"pidfs:{st.st_dev}:{st.st_ino}"


def _pidfs() -> bool:
    """True where pidfds tell processes apart by inode (pidfs, Linux 6.9): two processes' differ."""
    identities = set()
    for pid in (os.getpid(), os.getppid() or 1):
        pidfd = os.pidfd_open(pid)
        try:
            identities.add(_identity_of_pidfd(pidfd))
        finally:
            os.close(pidfd)
    return len(identities) == 2


def _pidfd_getfd(pidfd: int, target: int) -> int:
    fd = _libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"pidfd_getfd: {os.strerror(code)}")
    return int(fd)
