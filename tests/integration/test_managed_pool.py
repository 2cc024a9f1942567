"""The managed XFS pool (`--managed-pool xfs:SIZE`) on real loop devices, XFS and QSD.

`csi-qsd serve` runs as its own process, as in a pod. A node restart is
played as the machine would: the driver and QSD die, the XFS is shut down
without writing back its log (as a power cut leaves it), every mount and
loop device goes; the next start must attach the file again, mount it
(XFS replays its log) and serve the volumes with what they had synced.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.sys import filesystems, loop, mounts
from testing.harness import (
    DriverProcess,
    Sandbox,
    qsd_pids,
    release_host_state,
    running_driver,
    until,
    wait_restored,
    write_synced,
)

MIB = 1 << 20
PAYLOAD = os.urandom(3 * MIB)


def image_of(box: Sandbox) -> Path:
    return box.state_dir / "managed-pool" / "xfs.img"


def pool_of(box: Sandbox) -> Path:
    return box.state_dir / "pool"


def managed(box: Sandbox, size: str = "512Mi", *extra: str) -> DriverProcess:
    return DriverProcess(box, f"--managed-pool=xfs:{size}", *extra)


def assert_mounted(box: Sandbox) -> Path:
    """The pool directory holds the XFS of one direct-I/O loop device over the pool's file; that device."""
    entry = mounts.mounted_at(pool_of(box))
    assert entry is not None and entry.fs_type == "xfs", f"pool not mounted: {entry}"
    loops = loop.find_loop(image_of(box))
    assert [lp.device for lp in loops] == [Path(entry.source)], f"one loop device, the mount's: {loops} {entry}"
    assert loop.uses_direct_io(loops[0].device)
    assert not image_of(box).with_name("xfs.img.tmp").exists()
    return loops[0].device


async def xfs_bytes(box: Sandbox) -> int:
    return await filesystems.xfs_size(pool_of(box))


async def node_restart(box: Sandbox, driver: DriverProcess) -> None:
    """Everything a reboot takes: the processes, the pool's XFS (shut down, its log unwritten), mounts, loops."""
    await driver.kill9()
    subprocess.run(["xfs_io", "-x", "-c", "shutdown", str(pool_of(box))], check=True, capture_output=True)
    release_host_state(box.root)
    for pid in qsd_pids(box.state_dir):
        os.kill(pid, signal.SIGKILL)
    await until(lambda: not qsd_pids(box.state_dir), "QSD to be gone")
    for entry in mounts.mount_table():  # the FUSE exports of the dead QSD
        if box.root in entry.mount_point.parents:
            subprocess.run(["umount", "-l", str(entry.mount_point)], check=False, capture_output=True)
    await until(lambda: not loop.find_loop(image_of(box)) and mounts.mounted_at(pool_of(box)) is None,
                "the pool's mount and loop device to be gone")


async def crashed_at(driver: DriverProcess, point: str) -> None:
    """A start with crash point `point` armed dies there (SIGKILL, nothing cleaned up)."""
    with pytest.raises(RuntimeError, match="driver exited -9"):
        await driver.start(failpoints=point)
    assert f"event=failpoint name={point}" in driver.log()


async def volume_with_data(csi: CSIClient, box: Sandbox, name: str) -> tuple[str, Path, Path]:
    """A volume created, staged and published, PAYLOAD written and synced in it: (its ID, staging, target)."""
    vid = (await csi.create_volume(f"pvc-{name}", 64 * MIB)).volume_id
    staging, target = box.staging(name), box.target(name)
    await csi.stage(vid, str(staging))
    await csi.publish(vid, str(staging), str(target))
    write_synced(target / "data", PAYLOAD)
    return vid, staging, target


async def put_away(csi: CSIClient, vid: str, staging: Path, target: Path) -> None:
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))


async def refused(driver: DriverProcess, message: str) -> None:
    """The start fails, naming `message`, before anything serves."""
    with pytest.raises(RuntimeError, match="driver exited"):
        await driver.start()
    assert message in driver.log(), driver.log()[-3000:]


async def test_made_reused_and_attached_again_after_a_node_restart(box: Sandbox) -> None:
    async with running_driver(box, "--managed-pool=xfs:1Gi,sparse") as driver:
        device = assert_mounted(box)
        st = image_of(box).stat()
        assert st.st_size == 1 << 30 and st.st_blocks * 512 < st.st_size // 4, "sparse takes only what mkfs wrote"
        assert (1 << 30) - MIB <= await xfs_bytes(box) <= 1 << 30
        async with CSIClient(box.endpoint, timeout=60) as csi:
            # The capacity reported is the XFS's, not the host filesystem's.
            free = os.statvfs(pool_of(box))
            assert abs(await csi.capacity() - free.f_bavail * free.f_frsize) < 16 * MIB
            assert 700 * MIB < await csi.capacity() < 1 << 30
            vid, staging, target = await volume_with_data(csi, box, "on-xfs")
            images = list(pool_of(box).iterdir())
            assert images and all(os.stat(i).st_dev == os.stat(pool_of(box)).st_dev for i in images)

            # A driver restart takes the mount and its loop device up again: no new device, no new mkfs.
            inode = image_of(box).stat().st_ino
            await driver.kill9()
            await driver.start()
            assert assert_mounted(box) == device
            assert image_of(box).stat().st_ino == inode
            assert "event=managed_pool_mount_reused" in driver.log()
            assert driver.log().count("event=managed_pool_made") == 1
            assert (target / "data").read_bytes() == PAYLOAD

            # A node restart: the file is attached and mounted again, the volume rebuilt with its data.
            await node_restart(box, driver)
            await driver.start()
            assert_mounted(box)
            assert driver.log().count("event=managed_pool_loop_attached") == 1
            assert driver.log().count("event=managed_pool_made") == 1
            await wait_restored(csi, vid, target)
            assert (target / "data").read_bytes() == PAYLOAD
            await put_away(csi, vid, staging, target)
            await csi.delete_volume(vid)
            await until(lambda: not list(pool_of(box).iterdir()), "the pool to be empty")


async def test_grows_online_and_refuses_to_shrink(box: Sandbox) -> None:
    async with running_driver(box, "--managed-pool=xfs:512Mi") as driver, \
            CSIClient(box.endpoint, timeout=60) as csi:
        before = await csi.capacity()
        vid, staging, target = await volume_with_data(csi, box, "grow")
        await driver.stop()
        grown = managed(box, "768Mi")
        try:
            await grown.start()  # the volume stays staged: QSD holds its image while the XFS grows under it
            assert image_of(box).stat().st_size == 768 * MIB
            assert 767 * MIB <= await xfs_bytes(box) <= 768 * MIB
            assert loop.device_size(assert_mounted(box)) == 768 * MIB
            assert "event=managed_pool_grown" in grown.log()
            assert await csi.capacity() >= before + 250 * MIB
            assert (target / "data").read_bytes() == PAYLOAD
            await grown.stop()

            shrunk = managed(box, "512Mi")
            await refused(shrunk, "XFS cannot shrink; give at least 768Mi")
            assert image_of(box).stat().st_size == 768 * MIB
            assert (target / "data").read_bytes() == PAYLOAD  # the pool stays mounted and served meanwhile

            await grown.start()
            await put_away(csi, vid, staging, target)
        finally:
            await grown.stop()


async def test_reserves_the_whole_file_unless_sparse(box: Sandbox) -> None:
    async with running_driver(box, "--managed-pool=xfs:512Mi") as driver:
        assert_mounted(box)
        st = image_of(box).stat()
        assert st.st_blocks * 512 >= st.st_size
        # A trim gives the host back what XFS does not use (holes punched in the file); the next start
        # reserves it again.
        subprocess.run(["fstrim", str(pool_of(box))], check=True, capture_output=True)
        assert image_of(box).stat().st_blocks * 512 < st.st_size
        await driver.kill9()
        await driver.start()
        assert image_of(box).stat().st_blocks * 512 >= st.st_size


async def test_a_file_that_is_not_xfs_is_refused_never_formatted(box: Sandbox) -> None:
    image = image_of(box)
    image.parent.mkdir(parents=True)
    image.write_bytes(b"")
    os.truncate(image, 512 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    digest = hashlib.sha256(image.read_bytes()).hexdigest()
    await refused(managed(box), "is not an XFS filesystem: the driver formats only a file it has just made")
    assert hashlib.sha256(image.read_bytes()).hexdigest() == digest
    assert loop.find_loop(image) == [] and mounts.mounted_at(pool_of(box)) is None


async def test_refusals_that_would_hide_or_lose_volumes(box: Sandbox) -> None:
    # Volumes of a plain file pool in the directory: a mount over them would hide them.
    pool_of(box).mkdir(parents=True)
    (pool_of(box) / "vol-0123456789abcdef01234567.qcow2").write_bytes(b"")
    await refused(managed(box), "the managed pool would be mounted over them, hiding them")
    assert not image_of(box).exists(), "refused before anything was made"
    (pool_of(box) / "vol-0123456789abcdef01234567.qcow2").unlink()
    driver = managed(box)
    try:
        await driver.start()
        assert_mounted(box)
        await driver.stop()
        # Without the flag, the volumes on the managed pool would seem lost: refused, naming the flag.
        await refused(DriverProcess(box), "holds a managed xfs pool, but --managed-pool is not given")
    finally:
        await driver.stop()


CRASH_POINTS = ["managed_pool.after_file", "managed_pool.after_make_loop", "managed_pool.after_mkfs",
                "managed_pool.after_mount"]


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_crash_while_making_it(box: Sandbox, point: str) -> None:
    driver = managed(box)
    try:
        await crashed_at(driver, point)
        await driver.start()
        assert_mounted(box)
        assert driver.log().count("event=managed_pool_made") == 1
        if point in ("managed_pool.after_make_loop", "managed_pool.after_mkfs"):
            assert "event=managed_pool_leftover_detached" in driver.log()
        if point == "managed_pool.after_mount":
            assert "event=managed_pool_mount_reused" in driver.log()
        assert loop.find_loop(image_of(box).with_name("xfs.img.tmp")) == []
        async with CSIClient(box.endpoint, timeout=60) as csi:
            await csi.create_volume("pvc-after-crash", 64 * MIB)
    finally:
        await driver.stop()


async def test_crash_after_attaching_it_again(box: Sandbox) -> None:
    async with running_driver(box, "--managed-pool=xfs:512Mi") as driver:
        await node_restart(box, driver)
        await crashed_at(driver, "managed_pool.after_loop")
        assert len(loop.find_loop(image_of(box))) == 1 and mounts.mounted_at(pool_of(box)) is None
        await driver.start()
        assert_mounted(box)
        assert "event=managed_pool_loop_reused" in driver.log()


async def test_crash_while_growing_it(box: Sandbox) -> None:
    async with running_driver(box, "--managed-pool=xfs:512Mi"):
        pass
    grown = managed(box, "768Mi")
    try:
        await crashed_at(grown, "managed_pool.after_grow_file")
        assert image_of(box).stat().st_size == 768 * MIB
        assert await xfs_bytes(box) <= 512 * MIB
        await grown.start()
        assert 767 * MIB <= await xfs_bytes(box) <= 768 * MIB
    finally:
        await grown.stop()


async def test_a_host_too_small_refuses_a_reserved_pool_and_warns_of_a_sparse_one(box: Sandbox) -> None:
    # The pool's file on a 200 MiB host filesystem of its own, mounted where the driver keeps it.
    host, place = box.root / "host.img", image_of(box).parent
    host.write_bytes(b"")
    os.truncate(host, 200 * MIB)
    subprocess.run(["mkfs.ext4", "-q", str(host)], check=True, capture_output=True)
    place.mkdir(parents=True)
    subprocess.run(["mount", "-o", "loop", str(host), str(place)], check=True, capture_output=True)
    driver = managed(box, "512Mi,sparse")
    try:
        await refused(managed(box, "512Mi"), "cannot preallocate 536870912 bytes for the managed pool")
        assert list(place.iterdir()) == [place / "lost+found"], "the reservation that failed is removed"
        await driver.start()
        assert_mounted(box)
        assert "event=managed_pool_overcommitted" in driver.log()
        await driver.stop()
    finally:
        await driver.stop()
        subprocess.run(["umount", str(pool_of(box))], check=False, capture_output=True)
        for lp in loop.find_loop(image_of(box)):
            subprocess.run(["losetup", "-d", str(lp.device)], check=False, capture_output=True)
        subprocess.run(["umount", str(place)], check=False, capture_output=True)
