"""Many volumes at once, as a busy node sees them, with QSD killed in the middle.

Each worker drives one volume through its whole life the way a CO does:
a failed call is retried (with a bound). Calls cut off by the crash must
answer UNAVAILABLE (or ABORTED while another call holds the volume), never
an error that would make an operator look for a bug. The driver must end
with every volume's data intact and nothing left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from csi_qsd.csi_client import CSIClient
from csi_qsd.sys import mounts
from tests.harness import DriverProcess, Sandbox, qsd_pid, write_synced

MIB = 1 << 20
WORKERS = 12
RETRYABLE = (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)


UNEXPECTED: list[str] = []


async def as_a_co(call: Callable[[], Awaitable[object]]) -> None:
    for _ in range(300):
        try:
            await call()
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRYABLE:
                UNEXPECTED.append(f"{exc.code().name}: {exc.details()}")
        await asyncio.sleep(0.1)
    raise TimeoutError("the driver kept failing the call")



async def read_back(target: Path, block: bool, size: int) -> bytes:
    """Read the payload like a pod would; a read that meets the crash (EIO on the old mount) is redone
    through the target path once the driver has mounted it again (the documented behaviour)."""
    for _ in range(100):
        try:
            if not block:
                return (target / "data").read_bytes()
            fd = os.open(target, os.O_RDONLY)
            try:
                return os.pread(fd, size, MIB)
            finally:
                os.close(fd)
        except OSError:
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{target} stayed unreadable")


async def lifecycle(box: Sandbox, csi: CSIClient, n: int, killed: asyncio.Event) -> None:
    block = n % 3 == 0
    name = f"pvc-c{n}"
    vid = ""

    async def create() -> None:
        nonlocal vid
        vid = (await csi.create_volume(name, 32 * MIB, block=block)).volume_id

    await as_a_co(create)
    staging, target = box.staging(f"c{n}"), box.target(f"c{n}")
    payload = f"volume {n} ".encode() * 4096
    await as_a_co(lambda: csi.stage(vid, str(staging), block=block))
    await as_a_co(lambda: csi.publish(vid, str(staging), str(target), block=block))
    if block:
        fd = os.open(target, os.O_RDWR)
        os.pwrite(fd, payload, MIB)
        os.fsync(fd)
        os.close(fd)
    else:
        write_synced(target / "data", payload)
    await killed.wait()  # everyone's data is synced before QSD dies
    await as_a_co(lambda: csi.unpublish(vid, str(target)))
    await as_a_co(lambda: csi.unstage(vid, str(staging)))
    await as_a_co(lambda: csi.stage(vid, str(staging), block=block))
    await as_a_co(lambda: csi.publish(vid, str(staging), str(target), block=block))
    assert await read_back(target, block, len(payload)) == payload, f"volume {n} lost its data"
    await as_a_co(lambda: csi.unpublish(vid, str(target)))
    await as_a_co(lambda: csi.unstage(vid, str(staging)))
    await as_a_co(lambda: csi.delete_volume(vid))


async def wait_new_qsd(box: Sandbox, old: int) -> int:
    for _ in range(600):
        pid = qsd_pid(box)
        if pid is not None and pid != old:
            return pid
        await asyncio.sleep(0.05)
    raise TimeoutError("QSD was not restarted")


async def test_many_volumes_through_a_qsd_crash(box: Sandbox) -> None:
    UNEXPECTED.clear()
    driver = DriverProcess(box)
    await driver.start()
    try:
        async with CSIClient(box.endpoint, timeout=60) as csi:
            killed = asyncio.Event()
            workers = [asyncio.create_task(lifecycle(box, csi, n, killed)) for n in range(WORKERS)]
            for _ in range(600):
                if len([e for e in mounts.mount_table() if box.root in e.mount_point.parents]) >= WORKERS + 8:
                    break
                if any(w.done() for w in workers):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            pid = qsd_pid(box)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.set()
            # Once more while the workers are busy unstaging and staging again: calls in flight.
            new_pid = await wait_new_qsd(box, pid)
            for _ in range(600):
                if "event=qsd_recovered" in driver.log():
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            os.kill(new_pid, signal.SIGKILL)
            try:
                await asyncio.gather(*workers)
            finally:
                for worker in workers:
                    worker.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
            assert await csi.list_volumes() == []
        assert not UNEXPECTED, f"calls cut off by the crash answered {UNEXPECTED}"
        assert driver.log().count("event=qsd_recovered") == 2
        assert not [e for e in mounts.mount_table() if box.root in e.mount_point.parents and e.fs_type != "fuse"]
        assert list((box.state_dir / "pool").iterdir()) == []
    finally:
        await driver.stop()
