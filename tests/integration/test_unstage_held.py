"""Unstaging a volume something still holds loses nothing.

A pod's mount namespace can outlive kubelet's NodeUnpublishVolume by a few
milliseconds (its last process still exiting, an exec session ending). The
filesystem lives on there with its dirty pages and journal, and writes them
when that copy goes: the loop device and the FUSE export must still be
there then. Here a process in a private mount namespace (`unshare -m`)
holds such a copy while the volume is unstaged; and for a block volume, a
process that wrote through the device's page cache still has it open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.exports import fuse_loop
from csi_qsd.server import Driver
from csi_qsd.sys import mounts
from testing.harness import Sandbox, until

MIB = 1 << 20


class Holder:
    """A process in a private copy of this mount namespace: it keeps every filesystem mounted here alive."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def end(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


@contextlib.asynccontextmanager
async def hold_mounts(seconds: float, staging: Path) -> AsyncIterator[Holder]:
    proc = await asyncio.create_subprocess_exec("unshare", "--mount", "--propagation", "private", "sleep", str(seconds))
    holder = Holder(proc)
    try:
        own = os.readlink("/proc/self/ns/mnt")

        def copied() -> bool:
            try:
                if os.readlink(f"/proc/{proc.pid}/ns/mnt") == own:
                    return False
                return f" {staging} " in Path(f"/proc/{proc.pid}/mountinfo").read_text()
            except OSError:
                return False

        await until(copied, "the holder's private copy of the mounts", 10)
        yield holder
    finally:
        await holder.end()


async def staged_with_unsynced_file(csi: CSIClient, box: Sandbox, name: str) -> tuple[str, Path, Path, bytes]:
    volume = await csi.create_volume(name, 320 * MIB, fs_type="ext4")
    staging, target = box.staging(name), box.target(f"{name}-pod")
    await csi.stage(volume.volume_id, str(staging), fs_type="ext4")
    await csi.publish(volume.volume_id, str(staging), str(target), fs_type="ext4")
    return volume.volume_id, staging, target, os.urandom(256 * 1024)


async def reads_back(csi: CSIClient, box: Sandbox, volume_id: str, staging: Path, payload: bytes) -> None:
    await csi.stage(volume_id, str(staging), fs_type="ext4")
    again = box.target("again")
    await csi.publish(volume_id, str(staging), str(again), fs_type="ext4")
    assert (again / "data.bin").read_bytes() == payload
    await csi.unpublish(volume_id, str(again))
    await csi.unstage(volume_id, str(staging))


async def test_unstage_waits_for_a_copy_in_another_namespace_to_end(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    _, csi = driver
    volume_id, staging, target, payload = await staged_with_unsynced_file(csi, box, "held-briefly")
    async with hold_mounts(2, staging):
        (target / "data.bin").write_bytes(payload)  # in the page cache only: the filesystem still owes it
        await csi.unpublish(volume_id, str(target))
        started = time.monotonic()
        await csi.unstage(volume_id, str(staging))
        waited = time.monotonic() - started
        assert mounts.mounted_at(staging) is None
    await reads_back(csi, box, volume_id, staging, payload)
    # The holder let go 2 s after it started, about 1.5 s after the unstage began.
    assert waited > 0.5, f"unstage answered after {waited:.2f} s, while the holder still had the filesystem"


async def test_unstage_answers_unavailable_while_the_copy_stays_and_succeeds_after(
    box: Sandbox, driver: tuple[Driver, CSIClient], monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, csi = driver
    monkeypatch.setattr(fuse_loop, "FILESYSTEM_RELEASE_SECONDS", 1.0)
    volume_id, staging, target, payload = await staged_with_unsynced_file(csi, box, "held-long")
    async with hold_mounts(120, staging) as holder:
        (target / "data.bin").write_bytes(payload)
        await csi.unpublish(volume_id, str(target))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await csi.unstage(volume_id, str(staging))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "still mounted elsewhere" in str(refused.value.details())
        await holder.end()
    await csi.unstage(volume_id, str(staging))
    await reads_back(csi, box, volume_id, staging, payload)


# Writes through the block device's page cache, says so, and keeps the device open for a while: its last
# close is what writes the data to the device.
BLOCK_WRITER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
os.pwrite(fd, bytes.fromhex(sys.argv[2]), 0)
print("written", flush=True)
time.sleep(float(sys.argv[3]))
"""


async def test_unstage_of_a_block_volume_waits_for_a_process_that_still_has_it_open(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    _, csi = driver
    volume = await csi.create_volume("held-block", 64 * MIB, block=True)
    staging, target = box.staging("held-block"), box.target("held-block-pod")
    await csi.stage(volume.volume_id, str(staging), block=True)
    await csi.publish(volume.volume_id, str(staging), str(target), block=True)
    payload = os.urandom(16 * 1024)  # given as one argument, in hex
    # The device itself, as a container's own device node has it (not the target: a file open there would
    # keep the unpublish from unmounting it).
    device = f"/dev/loop{os.minor(os.stat(target).st_rdev)}"
    writer = await asyncio.create_subprocess_exec(sys.executable, "-c", BLOCK_WRITER, device, payload.hex(), "2",
                                                  stdout=asyncio.subprocess.PIPE)
    try:
        assert writer.stdout is not None
        assert await asyncio.wait_for(writer.stdout.readline(), 10) == b"written\n"
        await csi.unpublish(volume.volume_id, str(target))
        started = time.monotonic()
        await csi.unstage(volume.volume_id, str(staging))
        waited = time.monotonic() - started
    finally:
        if writer.returncode is None:
            writer.kill()
        await writer.wait()
    await csi.stage(volume.volume_id, str(staging), block=True)
    again = box.target("held-block-again")
    await csi.publish(volume.volume_id, str(staging), str(again), block=True)
    with open(again, "rb") as device:
        assert device.read(len(payload)) == payload
    await csi.unpublish(volume.volume_id, str(again))
    await csi.unstage(volume.volume_id, str(staging))
    assert waited > 0.5, f"unstage answered after {waited:.2f} s, while the writer still had the device open"
