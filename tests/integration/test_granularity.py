"""Changed-block granularity against the truth: a 4 KiB-granularity block volume, real QSD.

The volume's images are qcow2 with extended L2 entries (128 KiB clusters of
32 subclusters of 4 KiB). Writes that straddle subcluster and cluster
boundaries, overwrites, write-zeroes and discards between snapshots must be
reported at 4 KiB: every granule whose content changed, nothing the test did
not touch. Every image of the chain (the first one, each snapshot's overlay,
a restore's overlay) has the volume's layout, and a restore with the default
granularity gets plain 64 KiB clusters.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.qcow2 import extents, imagemap
from csi_qsd.server import Driver
from csi_qsd.sys.run import run
from testing.harness import Sandbox
from testing.helpers.written_blocks import SIZE, BlockDevice, check_delta, frozen_image, snapshot_content

KIB, MIB = 1 << 10, 1 << 20
GRANULE = 4 * KIB
CLUSTER = 32 * GRANULE
BLKZEROOUT = 0x127F
FINE = {"changedBlockGranularity": "4Ki"}


async def layout(qemu_img: str, image: Path) -> tuple[int, bool]:
    """(cluster size, extended L2) from the image's header."""
    _, out = await run(qemu_img, "info", "-U", "--output=json", str(image))
    info = json.loads(out)
    return info["cluster-size"], bool(info["format-specific"]["data"].get("extended-l2", False))


@pytest.fixture
async def fine_volume(box: Sandbox, driver: tuple[Driver, CSIClient]) -> tuple[str, BlockDevice]:
    _, csi = driver
    vid = (await csi.create_volume("pvc-fine", SIZE, FINE, block=True)).volume_id
    staging, target = box.staging("fine"), box.target("fine")
    await csi.stage(vid, str(staging), block=True)
    await csi.publish(vid, str(staging), str(target), block=True)
    return vid, BlockDevice(target, GRANULE)


async def test_delta_at_4k_reports_every_changed_granule_and_nothing_untouched(
    box: Sandbox, driver: tuple[Driver, CSIClient], fine_volume: tuple[str, BlockDevice],
) -> None:
    drv, csi = driver
    vid, dev = fine_volume
    for seed, (offset, length) in enumerate([(0, 1 * MIB), (8 * MIB, 256 * KIB)], 1):
        dev.write(offset, length, seed)  # the old data
    dev.cut()
    s0 = (await csi.create_snapshot("fine-0", vid)).snapshot_id

    # Scattered 4 KiB writes, overwrites of old data, and writes straddling boundaries.
    dev.write(4 * KIB, 4 * KIB, 3)                           # overwrite one granule of old data
    dev.write(CLUSTER - 2 * KIB, 4 * KIB, 4)                 # straddles a cluster (and granule) boundary
    dev.write(3 * MIB + 6 * KIB, 4 * KIB, 5)                 # straddles a granule boundary, inside a cluster
    dev.write(5 * MIB + 512, 512, 6)                         # one sector: its whole granule is reported
    dev.write(6 * MIB - 8 * KIB, 20 * KIB, 7)                # straddles a cluster boundary, several granules
    dev.write(SIZE - 4 * KIB, 4 * KIB, 8)                    # the last granule
    w1 = dev.cut()
    s1 = (await csi.create_snapshot("fine-1", vid)).snapshot_id
    reported = await check_delta(drv, csi, box, s0, s1, w1, granularity=GRANULE)
    assert len(reported) == 1 + 2 + 2 + 1 + 5 + 1

    # Write-zeroes of granules (zero subclusters), discards of a whole cluster (a zero cluster) and of a
    # part of one (qcow2 ignores it: the data stays, so nothing changed and nothing may be reported).
    dev.discard(8 * MIB + 8 * KIB, 8 * KIB, BLKZEROOUT)
    dev.discard(8 * MIB + CLUSTER, CLUSTER)
    dev.discard(16 * KIB, 4 * KIB)
    dev.write(20 * MIB, 4 * KIB, 9)
    w2 = dev.cut()
    s2 = (await csi.create_snapshot("fine-2", vid)).snapshot_id
    reported = await check_delta(drv, csi, box, s1, s2, w2, exact=False, granularity=GRANULE)
    assert reported >= extents.blocks([(8 * MIB + 8 * KIB, 8 * KIB), (8 * MIB + CLUSTER, CLUSTER),
                                       (20 * MIB, 4 * KIB)], GRANULE)
    # Across both cuts: the union, still at 4 KiB.
    await check_delta(drv, csi, box, s0, s2, w1 | w2, exact=False, granularity=GRANULE)

    # Allocated agrees with qemu-img map of the chain, at 4 KiB, and covers every non-zero granule.
    capacity, allocated = await csi.metadata_allocated(s2)
    assert capacity == SIZE
    image = await frozen_image(drv, s2)
    assert allocated == extents.clip(await imagemap.chain_allocation(drv.config.qemu_img, image), 0, SIZE)
    assert all(offset % GRANULE == 0 and length % GRANULE == 0 for offset, length in allocated)
    content = await snapshot_content(drv, s2, box.root / "a.raw")
    nonzero = {i for i in range(SIZE // GRANULE) if content[i * GRANULE:(i + 1) * GRANULE].count(0) != GRANULE}
    assert nonzero <= extents.blocks(allocated, GRANULE)
    assert extents.total(allocated) < 2 * MIB  # 4 KiB writes did not allocate whole 128 KiB clusters

    # Every image of the chain has the volume's layout.
    volume = await drv.volumes.get(vid)
    assert volume is not None and volume.params.granularity == GRANULE
    chain = [volume.image] + [await frozen_image(drv, s) for s in (s0, s1, s2)]
    for path in chain:
        assert await layout(drv.config.qemu_img, path) == (CLUSTER, True), path


async def test_restores_and_clones_take_their_own_granularity(
    driver: tuple[Driver, CSIClient], fine_volume: tuple[str, BlockDevice],
) -> None:
    drv, csi = driver
    vid = fine_volume[0]
    s0 = (await csi.create_snapshot("src-0", vid)).snapshot_id
    fine = (await csi.create_volume("pvc-fine-restore", SIZE, FINE, from_snapshot=s0)).volume_id
    plain = (await csi.create_volume("pvc-plain-restore", SIZE, from_snapshot=s0)).volume_id
    clone = (await csi.create_volume("pvc-fine-clone", SIZE, FINE, from_volume=vid)).volume_id
    expected = {fine: (CLUSTER, True), plain: (64 * KIB, False), clone: (CLUSTER, True)}
    for volume_id, want in expected.items():
        record = await drv.volumes.get(volume_id)
        assert record is not None
        assert await layout(drv.config.qemu_img, record.image) == want, volume_id
    # A snapshot of the default-granularity restore cuts a 64 KiB overlay, whatever its base has.
    await csi.create_snapshot("plain-0", plain)
    record = await drv.volumes.get(plain)
    assert record is not None and await layout(drv.config.qemu_img, record.image) == (64 * KIB, False)
    # The source's own overlay (made when the clone cut it) kept its 4 KiB layout.
    source = await drv.volumes.get(vid)
    assert source is not None and await layout(drv.config.qemu_img, source.image) == (CLUSTER, True)


@pytest.mark.parametrize("value", ["2Ki", "3Mi", "12Ki", "4KiB"])
async def test_a_bad_granularity_is_refused_naming_the_key(csi: CSIClient, value: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await csi.create_volume("pvc-bad", SIZE, {"changedBlockGranularity": value})
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "changedBlockGranularity" in (error.value.details() or "")


async def test_a_raw_volume_refuses_a_granularity(csi: CSIClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await csi.create_volume("pvc-raw", SIZE, {"format": "raw", **FINE})
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "changedBlockGranularity" in (error.value.details() or "") and "qcow2" in (error.value.details() or "")
