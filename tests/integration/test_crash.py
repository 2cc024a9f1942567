"""Crash safety: SIGKILL the driver between every step, and SIGKILL QSD under a mounted volume.

The driver runs as a separate `csi-qsd serve` process, as in a pod. After a
driver crash the next call (including a retry of the call that was cut off)
must succeed and the data must be intact; QSD must be adopted, not restarted.
After a QSD crash the driver must restore the export, loop device and mounts.
"""

from __future__ import annotations

import os
import signal

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.node.cut_off import REBUILT
from csi_qsd.sys import mounts
from testing.harness import DriverProcess, Sandbox, qsd_pid, until, wait_new_qsd, wait_restored, write_synced

MIB = 1 << 20


async def crash_and_restart(driver: DriverProcess) -> None:
    pid = qsd_pid(driver.box)
    await driver.kill9()
    await driver.start()
    assert qsd_pid(driver.box) == pid, "a restarted driver must adopt the running QSD, not replace it"


async def test_driver_sigkill_between_every_step(box: Sandbox, process: DriverProcess) -> None:
    csi = CSIClient(box.endpoint, timeout=60)
    try:
        staging, target = box.staging("crash"), box.target("pod")
        volume = await csi.create_volume("pvc-crash", 128 * MIB)
        await crash_and_restart(process)
        assert (await csi.create_volume("pvc-crash", 128 * MIB)).volume_id == volume.volume_id
        vid = volume.volume_id

        await csi.stage(vid, str(staging))
        await crash_and_restart(process)
        await csi.stage(vid, str(staging))  # the kubelet's retry
        assert mounts.mounted_at(staging) is not None

        await csi.publish(vid, str(staging), str(target))
        await crash_and_restart(process)
        await csi.publish(vid, str(staging), str(target))

        payload = os.urandom(2 * MIB)
        write_synced(target / "payload", payload)
        await crash_and_restart(process)
        assert (target / "payload").read_bytes() == payload
        write_synced(target / "after-restart", b"still writable")

        await csi.unpublish(vid, str(target))
        await crash_and_restart(process)
        await csi.unpublish(vid, str(target))
        assert mounts.mounted_at(target) is None

        await csi.unstage(vid, str(staging))
        await crash_and_restart(process)
        await csi.unstage(vid, str(staging))
        assert mounts.mounted_at(staging) is None

        await csi.stage(vid, str(staging))
        await csi.publish(vid, str(staging), str(target))
        assert (target / "payload").read_bytes() == payload
        assert (target / "after-restart").read_bytes() == b"still writable"
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))

        await csi.delete_volume(vid)
        await crash_and_restart(process)
        await csi.delete_volume(vid)
        assert await csi.list_volumes() == []
        await until(lambda: not list((box.state_dir / "pool").glob("vol-*")), "the deleted volumes' storage to be freed", 10)
    finally:
        await csi.close()


@pytest.mark.parametrize("block", [False, True], ids=["filesystem", "block"])
async def test_qsd_sigkill_under_published_volume(box: Sandbox, process: DriverProcess, block: bool) -> None:
    csi = CSIClient(box.endpoint, timeout=60)
    try:
        staging, target = box.staging("q"), box.target("pod")
        vid = (await csi.create_volume("pvc-qsd-crash", 64 * MIB, block=block)).volume_id
        await csi.stage(vid, str(staging), block=block)
        await csi.publish(vid, str(staging), str(target), block=block)
        payload = os.urandom(MIB)
        if block:
            fd = os.open(target, os.O_RDWR)
            os.pwrite(fd, payload, 7 * MIB)
            os.fsync(fd)
            os.close(fd)
        else:
            write_synced(target / "synced", payload)

        old_pid = qsd_pid(box)
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        new_pid = await wait_new_qsd(box, old_pid)
        await until(lambda: "event=qsd_recovered" in process.log(), "event=qsd_recovered in the driver log")
        await wait_restored(csi, vid, target)
        assert qsd_pid(box) == new_pid
        log = process.log()
        assert "event=qsd_lost" in log and "event=drop_stale" in log and "event=consumers_cut_off" in log
        # A container that took the target before the crash holds the dead data path: the target says so
        # until it is unpublished, the staging path is healthy.
        condition = (await csi.stats(vid, str(target))).volume_condition
        assert condition.abnormal and REBUILT in condition.message and vid in condition.message, condition
        assert not (await csi.stats(vid, str(staging))).volume_condition.abnormal
        if not block:  # the new mount stands over the dead one, where a HostToContainer container receives it
            stacked = [e for e in mounts.mount_table() if e.mount_point == target]
            assert len(stacked) == 2 and stacked[0].major_minor != stacked[1].major_minor, stacked

        # The same target path works again and holds every synced byte.
        if block:
            fd = os.open(target, os.O_RDWR)
            assert os.pread(fd, MIB, 7 * MIB) == payload
            os.pwrite(fd, payload[::-1], 9 * MIB)
            os.fsync(fd)
            os.close(fd)
        else:
            assert (target / "synced").read_bytes() == payload
            write_synced(target / "after", b"written after the restart")
        await csi.unpublish(vid, str(target))
        assert mounts.mounted_at(target) is None
        await csi.unstage(vid, str(staging))
        await csi.stage(vid, str(staging), block=block)
        await csi.publish(vid, str(staging), str(target), block=block)
        assert not (await csi.stats(vid, str(target))).volume_condition.abnormal
        if block:
            fd = os.open(target, os.O_RDONLY)
            assert os.pread(fd, MIB, 9 * MIB) == payload[::-1]
            os.close(fd)
        else:
            assert (target / "after").read_bytes() == b"written after the restart"
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        await csi.delete_volume(vid)
    finally:
        await csi.close()
