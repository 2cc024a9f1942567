"""Waiting for a process to be gone through its pidfd, child or not, and signalling it by that pidfd."""

from __future__ import annotations

import asyncio
import signal
import sys

from csi_qsd.sys.processes import WatchedProcess, wait_gone

SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")


async def test_a_running_process_is_not_gone_until_it_exits() -> None:
    child = await asyncio.create_subprocess_exec(*SLEEPER)
    process = WatchedProcess.open(child.pid)
    assert process is not None
    try:
        assert not await process.gone(0.05)
        process.send(signal.SIGTERM)
        assert await process.gone(10)
        assert await child.wait() == -signal.SIGTERM
        process.send(signal.SIGKILL)  # exited and reaped: nothing to signal, no error
        assert await process.gone(1)
    finally:
        process.close()


async def test_wait_gone_bounds_the_wait_and_knows_a_missing_process() -> None:
    child = await asyncio.create_subprocess_exec(*SLEEPER)
    try:
        assert not await wait_gone(child.pid, 0.05)
    finally:
        child.kill()
        await child.wait()
    assert await wait_gone(child.pid, 0)  # reaped: no such process any more
    assert WatchedProcess.open(child.pid) is None
