"""qemu-nbd on a UNIX socket for the driver's tools: one launcher that starts it, waits for its socket, stops it.

Backups read a snapshot and write a backup file through it, changed-block
records are read through it, and `csi-qsd volume nbd-export` serves a
snapshot with it. It runs with `--fork`: qemu-nbd's parent exits only once
the server listens on its socket, so nothing polls for the socket, and a
start that fails is a HostCommandError with qemu-nbd's own message. The
server's PID comes from its pid file in a private directory and is held as
a pidfd (`csi_qsd.sys.processes`).

Stopping is qemu.machine's ladder: SIGTERM (qemu-nbd ends its main loop and
closes its images), a bounded wait, then SIGKILL and an NBDError. Callers
rely on the wait: a backup file is used only once the server that wrote it
has closed it. (A copy across nodes reads a snapshot over TCP instead:
`nbd_tcp`.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from csi_qsd.errors import NBDError
from csi_qsd.sys.processes import WatchedProcess
from csi_qsd.sys.run import run

START_SECONDS = 60.0
STOP_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class NBDServer:
    """A running qemu-nbd: where it listens, and its process."""

    socket: Path
    process: WatchedProcess

    async def ended(self) -> None:
        """Return when the server has exited by itself (waits without bound)."""
        await self.process.gone(None)


@contextlib.asynccontextmanager
async def serving(
    qemu_nbd: str, image: str, socket: Path, *, writable: bool = False, persistent: bool = False,
    clients: int = 1, bitmaps: Sequence[str] = (), allocation_depth: bool = False, secret: str = "",
    stdin: bytes | None = None,
) -> AsyncIterator[NBDServer]:
    """qemu-nbd serving `image` (a filename or `json:` spec) on UNIX `socket`, listening; stopped on exit.

    `persistent`: it keeps serving when its clients leave (otherwise it
    exits after its first client). `clients`: how many at once. `bitmaps`:
    dirty bitmaps offered as `qemu:dirty-bitmap:NAME` contexts;
    `allocation_depth`: the `qemu:allocation-depth` context. `secret`: a
    `secret` object's `--object` options reading `stdin` (an encrypted
    image's key: on a pipe, never argv), read before qemu-nbd forks. Raises
    HostCommandError if it cannot start, NBDError if it does not stop.
    """
    argv = [qemu_nbd, "--fork", "--socket", str(socket), f"--shared={clients}"]
    argv += [] if writable else ["--read-only"]
    argv += ["--persistent"] if persistent else []
    argv += ["--allocation-depth"] if allocation_depth else []
    for name in bitmaps:
        argv += ["--bitmap", name]
    argv += ["--object", secret] if secret else []
    with tempfile.TemporaryDirectory(prefix="csi-qsd-nbd-") as work:
        pid_file = Path(work) / "pid"
        await run(*argv, "--pid-file", str(pid_file), image, timeout=START_SECONDS, stdin=stdin)
        pid = int(pid_file.read_text())
    process = WatchedProcess.open(pid)
    if process is None:
        raise NBDError(f"qemu-nbd {pid} serving {socket} exited as soon as it had started")
    try:
        yield NBDServer(socket, process)
    finally:
        try:
            await _stop(process, socket)
        finally:
            process.close()


async def _stop(process: WatchedProcess, socket: Path) -> None:
    """SIGTERM, wait; SIGKILL, wait; then NBDError: a server still running may still hold its image."""
    process.send(signal.SIGTERM)
    if await process.gone(STOP_SECONDS):
        return
    process.send(signal.SIGKILL)
    await process.gone(STOP_SECONDS)
    raise NBDError(f"qemu-nbd {process.pid} serving {socket} did not exit within {STOP_SECONDS:g}s of SIGTERM; "
                   "killed")
