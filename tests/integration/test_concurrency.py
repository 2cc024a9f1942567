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

from csi_qsd.cli.client import CSIClient
from csi_qsd.sys import mounts
from testing.harness import Sandbox, qsd_pid, running_driver, until, wait_new_qsd, write_synced

MIB = 1 << 20
WORKERS = 12
RETRYABLE = (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)


UNEXPECTED: list[str] = []


class Progress:
    """What the workers have done, for the test to wait on instead of guessing with sleeps."""

    def __init__(self) -> None:
        self.synced: set[int] = set()  # workers whose payload is written and fsynced
        self.calls = 0  # CSI calls that succeeded


async def as_a_co(call: Callable[[], Awaitable[object]], progress: Progress) -> None:
    """A CO's retry loop: a retryable failure is retried after a short back-off, a bounded number of times."""
    for _ in range(300):
        try:
            await call()
            progress.calls += 1
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRYABLE:
                UNEXPECTED.append(f"{exc.code().name}: {exc.details()}")
        await asyncio.sleep(0.1)  # back-off between retries, as a CO does
    raise TimeoutError("the driver kept failing the call")


async def read_back(target: Path, block: bool, size: int) -> bytes:
    """Read the payload like a pod would; a read that meets the crash (EIO on the old mount) is redone
    through the target path once the driver has mounted it again (the documented behaviour)."""

    def read() -> bytes | None:
        try:
            if not block:
                return (target / "data").read_bytes()
            fd = os.open(target, os.O_RDONLY)
            try:
                return os.pread(fd, size, MIB)
            finally:
                os.close(fd)
        except OSError:
            return None

    data = await until(read, f"{target} readable again", timeout=60, interval=0.2)
    assert data is not None
    return data


async def lifecycle(box: Sandbox, csi: CSIClient, n: int, killed: asyncio.Event, progress: Progress) -> None:
    block = n % 3 == 0
    name = f"pvc-c{n}"
    vid = ""

    async def create() -> None:
        nonlocal vid
        vid = (await csi.create_volume(name, 32 * MIB, block=block)).volume_id

    await as_a_co(create, progress)
    staging, target = box.staging(f"c{n}"), box.target(f"c{n}")
    payload = f"volume {n} ".encode() * 4096
    await as_a_co(lambda: csi.stage(vid, str(staging), block=block), progress)
    await as_a_co(lambda: csi.publish(vid, str(staging), str(target), block=block), progress)
    if block:
        fd = os.open(target, os.O_RDWR)
        os.pwrite(fd, payload, MIB)
        os.fsync(fd)
        os.close(fd)
    else:
        write_synced(target / "data", payload)
    progress.synced.add(n)
    await killed.wait()  # everyone's data is synced before QSD dies
    await as_a_co(lambda: csi.unpublish(vid, str(target)), progress)
    await as_a_co(lambda: csi.unstage(vid, str(staging)), progress)
    await as_a_co(lambda: csi.stage(vid, str(staging), block=block), progress)
    await as_a_co(lambda: csi.publish(vid, str(staging), str(target), block=block), progress)
    assert await read_back(target, block, len(payload)) == payload, f"volume {n} lost its data"
    await as_a_co(lambda: csi.unpublish(vid, str(target)), progress)
    await as_a_co(lambda: csi.unstage(vid, str(staging)), progress)
    await as_a_co(lambda: csi.delete_volume(vid), progress)


async def test_many_volumes_through_a_qsd_crash(box: Sandbox) -> None:
    UNEXPECTED.clear()
    async with running_driver(box) as driver, CSIClient(box.endpoint, timeout=60) as csi:
        killed, progress = asyncio.Event(), Progress()
        workers = [asyncio.create_task(lifecycle(box, csi, n, killed, progress)) for n in range(WORKERS)]
        try:

            def all_synced() -> bool:
                failed = [w for w in workers if w.done()]
                if failed:
                    failed[0].result()  # a worker that ended before the crash: show why
                    raise AssertionError("a worker finished before QSD was killed")
                return len(progress.synced) == WORKERS

            await until(all_synced, lambda: f"every worker's data synced ({sorted(progress.synced)})", 180)
            pid = qsd_pid(box)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.set()
            # Once more while the workers are busy unstaging and staging again: calls in flight.
            new_pid = await wait_new_qsd(box, pid)
            await until(lambda: "event=qsd_recovered" in driver.log(), "event=qsd_recovered in the driver log")
            calls = progress.calls
            await until(lambda: progress.calls >= calls + WORKERS, f"{WORKERS} more calls after the recovery")
            os.kill(new_pid, signal.SIGKILL)
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        assert await csi.list_volumes() == []
    assert not UNEXPECTED, f"calls cut off by the crash answered {UNEXPECTED}"
    assert driver.log().count("event=qsd_recovered") == 2
    assert not [e for e in mounts.mount_table() if box.root in e.mount_point.parents and e.fs_type != "fuse"]
    await until(lambda: list((box.state_dir / "pool").iterdir()) == [], "the deleted volumes' images to go", 10)
