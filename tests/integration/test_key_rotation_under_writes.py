"""Key rotation of encrypted volumes with a real QSD: under a writing pod, every layer, the old key then refused.

A pod writes and syncs without pause while ControllerModifyVolume (the
mutable parameter `keyVersion`) brings its volume, a chain of two images
under a live top, from one key to another: no write may fail. Afterwards
the new key opens every layer and the old one none, except the snapshot a
restore still reads through with the old key (until that restore is
rotated too); a QSD crash reopens the chain with the new key, a stage with
the old key is refused, and the key is in no log line.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path

import grpc

from csi_qsd.cli.client import CSIClient
from csi_qsd.pools.files import FilePool
from csi_qsd.sys.tools import bundled
from csi_qsd.sys.volume_keys import VolumeKey
from testing.harness import DriverProcess, Sandbox, crash_qsd, refused, write_synced

MIB = 1 << 20
ENCRYPTED = {"encrypted": "true"}


class Writer:
    """A pod's writer: 4 KiB at a time into one file, each write synced, until stopped; errors kept."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stop = threading.Event()
        self.errors: list[OSError] = []
        self.writes = 0
        self.longest = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Writer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            block = 0
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    os.pwrite(fd, block.to_bytes(8, "little") * 512, (block % 2048) * 4096)
                    os.fdatasync(fd)
                    self.writes += 1
                except OSError as exc:
                    self.errors.append(exc)
                self.longest = max(self.longest, time.monotonic() - started)
                block += 1
        finally:
            os.close(fd)

    def wait_writes(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        start = self.writes
        while self.writes < start + count:
            assert time.monotonic() < deadline, f"the writer made {self.writes - start} writes in {timeout}s"
            assert not self.errors, self.errors
            time.sleep(0.05)


def _images(box: Sandbox) -> list[Path]:
    return sorted((box.state_dir / "pool").glob("vol-*"))


async def test_a_key_rotates_under_a_writing_pod_on_every_layer_and_the_old_key_is_then_refused(
        box: Sandbox, process: DriverProcess) -> None:
    old, new = "k1-" + secrets.token_urlsafe(24), "k2-" + secrets.token_urlsafe(24)
    first = {"key": old, "keyVersion": "1"}
    rotated = {"key": new, "keyVersion": "2", "previousKey": old}
    pool = FilePool(box.state_dir / "pool", bundled("qemu-img"))
    csi = CSIClient(box.endpoint, timeout=120)
    try:
        vid = (await csi.create_volume("pvc-rot", 64 * MIB, ENCRYPTED, secrets=first)).volume_id
        staging, target = box.staging("rot"), box.target("pod")
        await csi.stage(vid, str(staging), secrets=first)
        await csi.publish(vid, str(staging), str(target))
        write_synced(target / "before", b"before-rotation" * 1000)
        snapshot = await csi.create_snapshot("snap-rot", vid)  # the chain: the snapshot's image under a new top
        restored = (await csi.create_volume("pvc-rot-restored", 64 * MIB, ENCRYPTED,
                                            from_snapshot=snapshot.snapshot_id, secrets=first)).volume_id
        images = _images(box)
        assert len(images) == 3

        await refused(csi.modify(vid, {"keyVersion": "3"}, rotated), grpc.StatusCode.FAILED_PRECONDITION,
                       vid, "'3'", "keyVersion")
        await refused(csi.modify(vid, {"keyVersion": "2"}, {**rotated, "key": ""}), grpc.StatusCode.INVALID_ARGUMENT,
                       "controller-modify-secret-name")
        with Writer(target / "written") as writer:
            writer.wait_writes(50)
            started = time.monotonic()
            await csi.modify(vid, {"keyVersion": "2"}, rotated)
            took = time.monotonic() - started
            writer.wait_writes(50)
        assert not writer.errors, writer.errors
        print(f"rotation took {took:.2f}s; {writer.writes} synced writes, the longest {writer.longest:.2f}s")
        await csi.modify(vid, {"keyVersion": "2"}, rotated)  # again: done already, nothing changes

        snapshot_image, top = box.state_dir / "pool" / f"{vid}.qcow2", box.state_dir / "pool" / f"{vid}.1.qcow2"
        assert {snapshot_image, top} < set(images)
        assert await pool.opens_with(top, VolumeKey(new)) and not await pool.opens_with(top, VolumeKey(old))
        # The restore still reads the snapshot's image with the old key: it keeps both until it is rotated too.
        assert await pool.opens_with(snapshot_image, VolumeKey(new))
        assert await pool.opens_with(snapshot_image, VolumeKey(old))
        assert f"kept_old_key_in={snapshot_image.name}" in process.log()

        await crash_qsd(box, csi, vid, target)  # the rebuild opens both layers with the key the node now holds
        assert (target / "before").read_bytes() == b"before-rotation" * 1000
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        await refused(csi.stage(vid, str(staging), secrets=first), grpc.StatusCode.PERMISSION_DENIED, vid)
        await csi.stage(vid, str(staging), secrets={"key": new, "keyVersion": "2"})
        await csi.publish(vid, str(staging), str(target))
        assert (target / "before").read_bytes() == b"before-rotation" * 1000
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))

        # The restore is not staged: its current key comes as previousKey; without it, the call says so.
        await refused(csi.modify(restored, {"keyVersion": "2"}, {"key": new, "keyVersion": "2"}),
                       grpc.StatusCode.INVALID_ARGUMENT, "previousKey", restored)
        await csi.modify(restored, {"keyVersion": "2"}, rotated)
        for image in _images(box):
            assert await pool.opens_with(image, VolumeKey(new)), image
            assert not await pool.opens_with(image, VolumeKey(old)), image
        staging2, target2 = box.staging("restored"), box.target("pod-2")
        await csi.stage(restored, str(staging2), secrets={"key": new})
        await csi.publish(restored, str(staging2), str(target2))
        assert (target2 / "before").read_bytes() == b"before-rotation" * 1000
        await csi.unpublish(restored, str(target2))
        await csi.unstage(restored, str(staging2))
        log = process.log()
        assert old not in log and new not in log
    finally:
        await csi.close()

