"""A device pool on another driver's block volume (deploy/overlays/cascade/), its storage stalling and coming back.

The backing driver's PVC is a loop device whose file lives on a FUSE
export of a second qemu-storage-daemon: the "other driver's storage",
which can stop answering (SIGSTOP, as a SAN path or a storage server
does) and come back (SIGCONT) with its bytes intact. The stable device
path the pool is configured with is a symlink, removed while the storage
is away as the device path goes when a backing device is detached.

Checks: a block volume carved from the claim lands at its extent; while
the storage is away the volume reports abnormal, a write to it waits (it
neither fails nor completes), and the node's QSD keeps answering QMP with
the same pid (the watchdog has no reason to replace it); once back, the
waiting write completes, the volume reports healthy, and the bytes written
before and during the outage are on the backing file.

On QEMU 11 with FUSE exports in iothreads, as run here. On QSD 10.0.13 a
FUSE export is served in QSD's main loop, which waits inside the stalled
write: the monitor stops answering (`query-named-block-nodes` timed out
and the watchdog took QSD as wedged), so filesystem and block volumes on
storage that can stall want QEMU 11 (or VM volumes, whose vhost-user-blk
exports are coroutines).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.qsd import features
from csi_qsd.sys.tools import bundled
from testing.harness import Sandbox, in_process_driver, qsd_pid, terminate, until
from testing.helpers.nvme_pools import pool_of

MIB = 1 << 20
CLAIM_BYTES = 128 * MIB
BEFORE = b"before the outage\n" * 3641  # 64 KiB - 2
DURING = b"written while away" * 3641


def mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


@contextlib.asynccontextmanager
async def backing_storage(root: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, Path, Path, str]]:
    """A second QSD serving a raw file over FUSE, a loop device on it (the claim), and a stable link to it."""
    image, mountpoint = root / "backing.raw", root / "backing"
    with open(image, "wb") as f:
        f.truncate(CLAIM_BYTES)
    mountpoint.touch()
    proc = await asyncio.create_subprocess_exec(
        bundled("qemu-storage-daemon"),
        "--blockdev", f"driver=file,node-name=disk,filename={image},cache.direct=on",
        "--export", f"type=fuse,id=claim,node-name=disk,mountpoint={mountpoint},writable=on",
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    loop_device = ""
    link = root / "pvc-0123"
    try:
        await until(lambda: mounted(mountpoint), "the backing QSD's FUSE export", 20)
        out = await asyncio.to_thread(subprocess.run, ["losetup", "--find", "--show", str(mountpoint)],
                                      check=True, capture_output=True, text=True)
        loop_device = out.stdout.strip()
        link.symlink_to(loop_device)
        yield proc, image, link, loop_device
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
        if loop_device:
            subprocess.run(["losetup", "-d", loop_device], check=False, capture_output=True)
        await terminate(proc)
        subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)


async def condition(csi: CSIClient, vid: str) -> Any:
    response: Any = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid), timeout=30)
    return response.status.volume_condition


def on_file(image: Path, offset: int, length: int) -> bytes:
    with open(image, "rb") as f:
        f.seek(offset)
        return f.read(length)


async def test_a_claim_that_stalls_reports_abnormal_and_serves_again(box: Sandbox) -> None:
    async with backing_storage(box.root) as (storage, image, link, device):
        async with in_process_driver(box, device_pools=(DevicePoolSpec("cascade", link),),
                                     qsd_binary=bundled("qemu-storage-daemon-11"), iothreads=2,
                                     fuse_threads=features.FuseThreads.POOL) as (driver, csi):
            assert driver.daemon.fuse_iothreads(), "QEMU 11 serves FUSE exports in iothreads"
            vol = await csi.create_volume("pvc-on-claim", 16 * MIB, {"pool": "cascade"}, block=True)
            staging, target = box.staging("c"), box.target("c")
            await csi.stage(vol.volume_id, str(staging), block=True)
            await csi.publish(vol.volume_id, str(staging), str(target), block=True)
            extent = pool_of(driver, "cascade").extent_of(vol.volume_id)
            assert extent is not None
            fd = os.open(target, os.O_WRONLY)
            try:
                os.pwrite(fd, BEFORE, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            assert on_file(image, extent.start, len(BEFORE)) == BEFORE  # through both QSDs onto the claim's file
            assert not (await condition(csi, vol.volume_id)).abnormal
            pid = qsd_pid(box)

            os.kill(storage.pid, signal.SIGSTOP)  # the backing storage stops answering
            link.unlink()  # and its device path goes
            writer = await asyncio.create_subprocess_exec(
                "dd", f"of={target}", "oflag=direct,seek_bytes", f"seek={1 * MIB}", "bs=64k", "conv=notrunc,fsync",
                "status=none", stdin=subprocess.PIPE, stderr=subprocess.PIPE)
            assert writer.stdin is not None
            writer.stdin.write(DURING)
            writer.stdin.close()
            try:
                status = await condition(csi, vol.volume_id)
                assert status.abnormal and "cascade" in status.message and "gone" in status.message, status
                # The node's QSD answers its monitor at once while a write to the claim waits on the storage.
                names = await asyncio.wait_for(driver.daemon.client.node_names(), 2.0)
                assert names and driver.daemon.ready and qsd_pid(box) == pid
                assert writer.returncode is None, "the write neither waited nor failed as the storage does"
            finally:
                os.kill(storage.pid, signal.SIGCONT)  # the storage comes back
                link.symlink_to(device)  # and so does its path
            _, err = await asyncio.wait_for(writer.communicate(), 60)
            assert writer.returncode == 0, err
            await until(lambda: condition_healthy(csi, vol.volume_id), "the volume healthy again", 30)
            assert qsd_pid(box) == pid  # the same QSD throughout: nothing was restarted
            assert on_file(image, extent.start, len(BEFORE)) == BEFORE
            assert on_file(image, extent.start + MIB, len(DURING)) == DURING
            await csi.unpublish(vol.volume_id, str(target))
            await csi.unstage(vol.volume_id, str(staging))
            await csi.delete_volume(vol.volume_id)


async def condition_healthy(csi: CSIClient, vid: str) -> bool:
    return not (await condition(csi, vid)).abnormal
