"""Changed-block tracking checked against the truth: known writes to a block volume, read back from snapshots.

`BlockDevice` writes and discards through a published block device as a
database would (O_DIRECT, then fsync) and remembers the granules it
touched since its last `cut`. `check_delta` compares GetMetadataDelta
between two snapshots with that record and with what really changed:
the two snapshots' contents, read by qemu-img from their frozen images
(never through QSD).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from csi_qsd.qcow2 import extents, keyed
from csi_qsd.server import Driver
from csi_qsd.sys.run import run
from csi_qsd.sys.volume_keys import VolumeKey
from testing.harness import Sandbox

KIB, MIB = 1 << 10, 1 << 20
CLUSTER = 64 * KIB  # the default changed-block granularity
SIZE = 64 * MIB  # the block volumes these checks make: the capacity `check_delta` expects
BLKDISCARD = 0x1277


class BlockDevice:
    """The volume's published block device file, written the way a database would: O_DIRECT, then fsync."""

    def __init__(self, path: Path, granularity: int = CLUSTER) -> None:
        self.path = path
        self.granularity = granularity
        self.touched: set[int] = set()  # granules written or discarded since the last `cut`

    def write(self, offset: int, length: int, seed: int) -> None:
        buf = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT needs
        buf.write(bytes([seed % 251 + 1]) * length)
        fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwrite(fd, buf, offset) == length
            os.fsync(fd)
        finally:
            os.close(fd)
        self.touched |= extents.blocks([(offset, length)], self.granularity)

    def discard(self, offset: int, length: int, request: int = BLKDISCARD) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.ioctl(fd, request, struct.pack("QQ", offset, length))
            os.fsync(fd)
        finally:
            os.close(fd)
        self.touched |= extents.blocks([(offset, length)], self.granularity)

    def cut(self) -> set[int]:
        touched, self.touched = self.touched, set()
        return touched


async def frozen_image(drv: Driver, snapshot_id: str) -> Path:
    """The image holding a snapshot's data (with its backing chain), as the catalog records it."""
    snapshot = await drv.catalog.snapshot(snapshot_id)
    assert snapshot is not None, snapshot_id
    return snapshot.image


async def snapshot_content(drv: Driver, snapshot_id: str, out: Path, key: str = "") -> bytes:
    """A snapshot's data, read from its frozen image chain (an encrypted one's with its passphrase `key`)."""
    image = await frozen_image(drv, snapshot_id)
    if key:
        await run(drv.config.qemu_img, "convert", "--object", keyed.SECRET, "-O", "raw",
                  keyed.json_name(keyed.chain_spec(image)), str(out), stdin=VolumeKey(key).base64().encode())
    else:
        await run(drv.config.qemu_img, "convert", "-U", "-f", "qcow2", "-O", "raw", str(image), str(out))
    data = out.read_bytes()
    out.unlink()
    return data


def changed_clusters(old: bytes, new: bytes, granularity: int = CLUSTER) -> set[int]:
    """The granules whose bytes differ between two images of the same size."""
    g = granularity
    return {i for i in range(len(new) // g) if old[i * g:(i + 1) * g] != new[i * g:(i + 1) * g]}


async def check_delta(drv: Driver, csi: CSIClient, box: Sandbox, base: str, target: str, touched: set[int],
                      *, exact: bool = True, within_touched: bool = True, granularity: int = CLUSTER,
                      key: str = "") -> set[int]:
    """The delta's granules, checked: every changed granule reported; with `exact` exactly the touched ones.

    `key`: the passphrase of an encrypted volume, to read the snapshots' contents.

    `within_touched` without `exact`: nothing the test did not touch (a
    discard qcow2 ignores leaves a touched granule unchanged, unreported).
    """
    capacity, ranges = await csi.metadata_delta(base, target)
    assert capacity == SIZE
    assert ranges == sorted(ranges) and extents.coalesce(ranges) == ranges
    assert all(offset % granularity == 0 and length % granularity == 0 for offset, length in ranges)
    reported = extents.blocks(ranges, granularity)
    truth = changed_clusters(await snapshot_content(drv, base, box.root / "b.raw", key),
                             await snapshot_content(drv, target, box.root / "t.raw", key), granularity)
    assert truth <= reported, f"changed granules not reported: {sorted(truth - reported)[:10]}"
    if within_touched:
        assert reported <= touched, f"reported, not touched: {sorted(reported - touched)[:10]}"
    if exact:
        # Every write and discard of whole clusters leaves a cluster in the overlay: exactly the touched ones.
        assert reported == touched, f"reported-touched {sorted(reported - touched)[:10]}, missing {sorted(touched - reported)[:10]}"
    return reported
