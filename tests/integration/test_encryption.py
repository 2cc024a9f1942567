"""Encrypted volumes with a real QSD: what a pod writes is ciphertext in every image, and the key is checked and kept.

A known pattern is written through a filesystem volume, a block volume and
the top over a snapshot, then searched for in every image file of the
pool: it must be in none. The key must be in no log line, image or catalog
page. A stage without the key, or with another, is refused with nothing
left behind; a QSD crash re-opens the chain from the key the node holds.
"""

from __future__ import annotations

import mmap
import os
import secrets
import subprocess
from pathlib import Path

import grpc

from csi_qsd.cli.client import CSIClient
from csi_qsd.publish import vhost_user
from csi_qsd.sys import mounts
from csi_qsd.sys.tools import bundled
from testing import tiers
from testing.harness import DriverProcess, Sandbox, crash_qsd, refused, write_synced
from testing.helpers.ciphertext import holds, luks
from testing.helpers.ciphertext import marker as new_marker

MIB = 1 << 20
ENCRYPTED = {"encrypted": "true"}


def _images(box: Sandbox) -> list[Path]:
    return sorted((box.state_dir / "pool").glob("vol-*"))


async def test_a_pod_s_filesystem_and_a_snapshot_are_ciphertext_and_the_key_is_checked_kept_and_never_logged(
        box: Sandbox, process: DriverProcess) -> None:
    key = "k-" + secrets.token_urlsafe(24)
    secret = {"key": key}
    marker, later = new_marker(), new_marker()
    csi = CSIClient(box.endpoint, timeout=120)
    try:
        await refused(csi.create_volume("pvc-enc", 64 * MIB, ENCRYPTED), grpc.StatusCode.INVALID_ARGUMENT,
                       "csi.storage.k8s.io/provisioner-secret-name", "'key'")
        vid = (await csi.create_volume("pvc-enc", 64 * MIB, ENCRYPTED, secrets=secret)).volume_id
        (image,) = _images(box)
        assert luks(image)

        staging, target = box.staging("enc"), box.target("pod")
        await refused(csi.stage(vid, str(staging)), grpc.StatusCode.INVALID_ARGUMENT,
                       "csi.storage.k8s.io/node-stage-secret-name", vid)
        await refused(csi.stage(vid, str(staging), secrets={"key": key + "x"}), grpc.StatusCode.PERMISSION_DENIED,
                       "csi.storage.k8s.io/node-stage-secret-name", vid)
        assert mounts.mounted_at(staging) is None
        assert not (box.runtime_dir / "keys" / vid).exists()

        await csi.stage(vid, str(staging), secrets=secret)
        await csi.publish(vid, str(staging), str(target))
        write_synced(target / "pattern", marker * (2 * MIB // len(marker)))
        snapshot = await csi.create_snapshot("snap-enc", vid)  # the node holds the key: no Secret needed
        write_synced(target / "later", later * (MIB // len(later)))

        await crash_qsd(box, csi, vid, target)  # the rebuild opens both layers with the key the node holds
        assert (target / "pattern").read_bytes().startswith(marker)
        assert (target / "later").read_bytes().startswith(later)
        await refused(csi.stage(vid, str(staging), secrets={"key": key + "x"}), grpc.StatusCode.PERMISSION_DENIED,
                       vid)

        restored = (await csi.create_volume("pvc-restored", 64 * MIB, ENCRYPTED, from_snapshot=snapshot.snapshot_id,
                                            secrets=secret)).volume_id
        await refused(csi.create_volume("pvc-plain", 64 * MIB, from_snapshot=snapshot.snapshot_id),
                       grpc.StatusCode.INVALID_ARGUMENT, snapshot.snapshot_id)
        await refused(csi.create_volume("pvc-wrong", 64 * MIB, ENCRYPTED, from_snapshot=snapshot.snapshot_id,
                                         secrets={"key": "wrong"}), grpc.StatusCode.PERMISSION_DENIED,
                       "csi.storage.k8s.io/provisioner-secret-name")
        staging2, target2 = box.staging("restored"), box.target("pod-2")
        await csi.stage(restored, str(staging2), secrets=secret)
        await csi.publish(restored, str(staging2), str(target2))
        assert (target2 / "pattern").read_bytes().startswith(marker)
        assert not (target2 / "later").exists()

        for volume, stage, pod in ((vid, staging, target), (restored, staging2, target2)):
            await csi.unpublish(volume, str(pod))
            await csi.unstage(volume, str(stage))
        assert not list((box.runtime_dir / "keys").iterdir())  # unstaged: the node forgot the keys

        images = _images(box)
        assert len(images) >= 3  # the snapshot's image, the volume's top over it, the restored volume's
        for path in images:
            assert luks(path), path
            for needle in (marker, later, key.encode()):
                assert not holds(path, needle), (path, needle[:12])
        for path in box.state_dir.rglob("*"):
            if path.is_file() and path.suffix not in (".sock",):
                assert not holds(path, key.encode()), path
        assert key not in process.log()
    finally:
        await csi.close()


async def test_a_block_volume_is_ciphertext_and_grows(box: Sandbox, process: DriverProcess) -> None:
    key = secrets.token_urlsafe(32)
    marker = new_marker()
    csi = CSIClient(box.endpoint, timeout=120)
    try:
        vid = (await csi.create_volume("pvc-enc-block", 32 * MIB, ENCRYPTED, block=True,
                                       secrets={"key": key})).volume_id
        staging, target = box.staging("blk"), box.target("pod")
        await csi.stage(vid, str(staging), block=True, secrets={"key": key})
        await csi.publish(vid, str(staging), str(target), block=True)
        fd = os.open(target, os.O_RDWR | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, MIB)
            buf.write((marker * (MIB // len(marker) + 1))[:MIB])
            os.pwritev(fd, [buf], 3 * MIB)
            os.fsync(fd)
        finally:
            os.close(fd)
        await csi.unpublish(vid, str(target))
        assert await csi.expand(vid, str(staging), 64 * MIB) == 64 * MIB
        await csi.publish(vid, str(staging), str(target), block=True)
        fd = os.open(target, os.O_RDONLY)
        try:
            assert os.lseek(fd, 0, os.SEEK_END) == 64 * MIB
            assert os.pread(fd, len(marker), 3 * MIB) == marker
        finally:
            os.close(fd)
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        (image,) = _images(box)
        assert luks(image) and not holds(image, marker) and not holds(image, key.encode())

        # Not staged: a snapshot's new top needs the key from the snapshotter's Secret, checked first.
        await refused(csi.create_snapshot("snap-unstaged", vid), grpc.StatusCode.INVALID_ARGUMENT,
                       "csi.storage.k8s.io/snapshotter-secret-name", vid)
        await refused(csi.create_snapshot("snap-unstaged", vid, secrets={"key": "wrong"}),
                       grpc.StatusCode.PERMISSION_DENIED, "csi.storage.k8s.io/snapshotter-secret-name", vid)
        assert _images(box) == [image]
        await csi.create_snapshot("snap-unstaged", vid, secrets={"key": key})
        clone = (await csi.create_volume("pvc-clone", 64 * MIB, ENCRYPTED, block=True, from_volume=vid,
                                         secrets={"key": key})).volume_id
        staging2, target2 = box.staging("clone"), box.target("pod-2")
        await csi.stage(clone, str(staging2), block=True, secrets={"key": key})
        await csi.publish(clone, str(staging2), str(target2), block=True)
        fd = os.open(target2, os.O_RDONLY)
        try:
            assert os.pread(fd, len(marker), 3 * MIB) == marker
        finally:
            os.close(fd)
        await csi.unpublish(clone, str(target2))
        await csi.unstage(clone, str(staging2))
        assert len(_images(box)) == 4  # the volume's first image, two cuts over it, the clone's overlay
        assert all(luks(path) and not holds(path, marker) for path in _images(box))
        assert key not in process.log()
    finally:
        await csi.close()


def _blkio_missing() -> bool:
    out = subprocess.run([bundled("qemu-img"), "--help"], capture_output=True, text=True, check=False).stdout
    return "virtio-blk-vhost-user" not in out


@tiers.needs("integration", "the bundled QEMU's virtio-blk-vhost-user driver (libblkio)" if _blkio_missing() else "")
async def test_a_vm_disk_over_vhost_user_blk_is_ciphertext(box: Sandbox, process: DriverProcess) -> None:
    key = secrets.token_urlsafe(32)
    csi = CSIClient(box.endpoint, timeout=120)
    try:
        vid = (await csi.create_volume("vm-enc", 32 * MIB, {**ENCRYPTED, "export": "vhost-user-blk"},
                                       secrets={"key": key})).volume_id
        staging, target = box.staging("vm"), box.target("vm-pod")
        await csi.stage(vid, str(staging), secrets={"key": key})
        await csi.publish(vid, str(staging), str(target))
        # What a guest writes, through the socket as a VMM's disk would: 1 MiB of 0x5a at 1 MiB, read back.
        socket = target / vhost_user.SOCKET_NAME
        argv = [bundled("qemu-io"), "--image-opts", f"driver=virtio-blk-vhost-user,path={socket},cache.direct=on",
                "-c", "write -P 0x5a 1M 1M", "-c", "read -P 0x5a 1M 1M"]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
        assert done.returncode == 0 and "read 1048576/1048576 bytes" in done.stdout, done.stdout + done.stderr
        assert "verification failed" not in done.stdout
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        (image,) = _images(box)
        assert luks(image) and image.stat().st_size > MIB  # the write reached the image, as ciphertext
        assert not holds(image, b"\x5a" * 4096) and not holds(image, key.encode())
    finally:
        await csi.close()


async def test_a_driver_restarted_after_the_stage_reopens_the_volume_when_qsd_crashes(
        box: Sandbox, process: DriverProcess) -> None:
    """The key of a staged volume outlives the driver in the runtime directory: no new NodeStageVolume comes."""
    key = secrets.token_urlsafe(32)
    marker = new_marker()
    csi = CSIClient(box.endpoint, timeout=120)
    try:
        vid = (await csi.create_volume("pvc-enc-restart", 64 * MIB, ENCRYPTED, secrets={"key": key})).volume_id
        staging, target = box.staging("r"), box.target("pod")
        await csi.stage(vid, str(staging), secrets={"key": key})
        await csi.publish(vid, str(staging), str(target))
        write_synced(target / "pattern", marker * 4096)
        await process.kill9()
        await process.start()
        await crash_qsd(box, csi, vid, target)
        assert (target / "pattern").read_bytes() == marker * 4096
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        assert key not in process.log()
    finally:
        await csi.close()
