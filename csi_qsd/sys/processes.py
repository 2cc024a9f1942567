"""Waiting for a process to be gone, through its pidfd: no polling, and no signal to a recycled PID.

A pidfd becomes readable when its process exits, whether the process is
this one's child or not (a qemu-nbd that forked itself into the
background, a QSD this driver adopted), so the event loop waits on it as
on a socket. A zombie counts as gone: it serves nothing any more. A
signal sent through the pidfd reaches the process it was opened for, even
once that process's PID has been handed to another.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal


class WatchedProcess:
    """One process held by its pidfd; `close` it when done."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd = fd

    @classmethod
    def open(cls, pid: int) -> WatchedProcess | None:
        """The process `pid`, or None if there is none (it is gone already)."""
        try:
            return cls(pid, os.pidfd_open(pid))
        except ProcessLookupError:
            return None

    def send(self, signum: signal.Signals) -> None:
        """Signal the process if it still runs; nothing if it has exited."""
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._fd, signum)

    async def gone(self, timeout: float | None) -> bool:
        """True once the process has exited; False if it still runs after `timeout` seconds (None: no bound)."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(self._fd, readable)
        try:
            await asyncio.wait_for(exited, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(self._fd)

    def close(self) -> None:
        os.close(self._fd)


async def wait_gone(pid: int, timeout: float | None) -> bool:
    """True once process `pid` has exited (at once if there is none), False if it still runs after `timeout` s."""
    process = WatchedProcess.open(pid)
    if process is None:
        return True
    try:
        return await process.gone(timeout)
    finally:
        process.close()
