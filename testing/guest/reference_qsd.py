"""A bare qemu-storage-daemon serving image files as vhost-user-blk, for harness tests.

Deliberately independent of the ``csi_qsd`` package: it is the known-good
reference backend that proves the guest harness itself, so a bug in the
driver cannot hide behind a matching bug in the harness.

Readiness without polling: the test process listens on the QMP socket and
QSD connects to it as a client (``server=off``). QSD processes its options in
command-line order and ``--monitor`` comes last, so once the QMP session is
up every export socket already listens. Stopping is QMP ``quit`` followed by
waiting for the process, which is when QSD has flushed and closed the images.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

from qemu.qmp import QMPClient
from qemu.qmp.error import QMPError

log = logging.getLogger(__name__)

_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes including the NUL


class StorageDaemonError(RuntimeError):
    """qemu-storage-daemon failed to start or to stop cleanly."""


@dataclass(frozen=True)
class VhostUserExport:
    """One image file exported over a vhost-user-blk unix socket.

    ``writethrough=True`` makes QSD flush the image after every write before
    completing it. That matters because QSD 7.2's vhost-user-blk export
    reports ``wce=0`` in its config space: with QEMU's default
    ``config-wce=on`` the guest then believes the disk is write-through and
    never sends a flush, so without this (or ``config-wce=off`` on the QEMU
    side) guest-acknowledged writes to a qcow2 image are lost if QSD dies.
    """

    image: Path
    socket_path: Path
    format: Literal["qcow2", "raw"] = "qcow2"
    num_queues: int = 1
    writable: bool = True
    writethrough: bool = False


def qsd_binary() -> str:
    return os.environ.get("CSI_QSD_QSD_BINARY", "qemu-storage-daemon")


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ValueError(f"unix socket path too long ({len(os.fsencode(path))} > {_SUN_PATH_MAX}): {path}")


def _escape(value: str) -> str:
    return value.replace(",", ",,")


def qsd_command(exports: Sequence[VhostUserExport], qmp_socket: Path) -> list[str]:
    cmd = [qsd_binary()]
    for i, exp in enumerate(exports):
        cmd += [
            "--blockdev", f"driver=file,node-name=file{i},filename={_escape(str(exp.image))}",
            "--blockdev", f"driver={exp.format},node-name=disk{i},file=file{i}",
            "--export",
            f"type=vhost-user-blk,id=e{i},node-name=disk{i},addr.type=unix,"
            f"addr.path={_escape(str(exp.socket_path))},writable={'on' if exp.writable else 'off'},"
            f"num-queues={exp.num_queues},writethrough={'on' if exp.writethrough else 'off'}",
        ]  # fmt: skip
    # Must stay last: the QMP session coming up is the readiness signal.
    cmd += [
        "--chardev", f"socket,id=qmp,path={_escape(str(qmp_socket))},server=off",
        "--monitor", "chardev=qmp",
    ]  # fmt: skip
    return cmd


class StorageDaemon:
    """A running qemu-storage-daemon; an async context manager that stops it on exit."""

    def __init__(self, proc: asyncio.subprocess.Process, qmp: QMPClient) -> None:
        self._proc = proc
        self.qmp = qmp
        self._stderr: list[str] = []
        self._stderr_task = asyncio.create_task(self._pump_stderr())

    async def _pump_stderr(self) -> None:
        assert self._proc.stderr is not None
        while line := await self._proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            log.debug("qsd[%d]: %s", self._proc.pid, text)
            self._stderr.append(text)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def stderr(self) -> str:
        return "\n".join(self._stderr)

    async def stop(self, timeout: float = 30.0) -> int:
        """Asks QSD to quit over QMP and waits until it has closed its images.

        Returns QSD's exit status; raises if it had to be killed.
        """
        if self._proc.returncode is None:
            with contextlib.suppress(QMPError, OSError, EOFError):
                await self.qmp.execute("quit")
        with contextlib.suppress(QMPError, OSError, EOFError):
            await self.qmp.disconnect()
        try:
            await asyncio.wait_for(self._proc.wait(), timeout)
        except TimeoutError:
            self._proc.kill()
            await self._proc.wait()
            await self._stderr_task
            raise StorageDaemonError(f"qemu-storage-daemon ignored quit for {timeout}s:\n{self.stderr}") from None
        await self._stderr_task
        return self._proc.returncode if self._proc.returncode is not None else -1

    async def kill(self) -> None:
        """SIGKILLs QSD, as a crash would (no flush of image metadata)."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        await self.stop()

    async def __aenter__(self) -> StorageDaemon:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def start_storage_daemon(
    exports: Sequence[VhostUserExport], qmp_socket: Path, *, timeout: float = 30.0
) -> StorageDaemon:
    """Starts QSD with ``exports`` and returns once every export socket listens."""
    for path in (qmp_socket, *(e.socket_path for e in exports)):
        _check_socket_path(path)
    qmp = QMPClient("qsd")
    await qmp.start_server(str(qmp_socket))
    proc = await asyncio.create_subprocess_exec(
        *qsd_command(exports, qmp_socket),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    daemon = StorageDaemon(proc, qmp)
    accept = asyncio.create_task(qmp.accept())
    exited = asyncio.create_task(proc.wait())
    done, _ = await asyncio.wait({accept, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if accept in done and accept.exception() is None:
        exited.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await exited
        return daemon
    accept.cancel()
    with contextlib.suppress(asyncio.CancelledError, QMPError, OSError):
        await accept
    reason = "exited" if exited in done else "did not connect to QMP in time"
    exited.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await exited
    await daemon.kill()
    raise StorageDaemonError(f"qemu-storage-daemon {reason}:\n{daemon.stderr}")
