"""Changed-block tracking against the truth: known writes between snapshots of a real block volume.

Writes go through the published block device with O_DIRECT and fsync. The
truth at 64 KiB granularity is twofold: the clusters the test touched, and
the clusters whose content differs between the two snapshots (read from
their frozen images). GetMetadataDelta must report every cluster whose
content changed, and nothing the test did not touch unless it said it fell
back to a superset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import sys

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.qcow2 import extents, image_bitmaps, imagemap, keyed, layer_bitmaps
from csi_qsd.server import Driver
from csi_qsd.sys.run import run
from csi_qsd.sys.tools import bundled
from csi_qsd.sys.volume_keys import VolumeKey
from testing.harness import Sandbox, crash_qsd, qsd_pid, wait_restored
from testing.helpers.written_blocks import CLUSTER, SIZE, BlockDevice, check_delta, frozen_image, snapshot_content

KIB, MIB = 1 << 10, 1 << 20


async def new_qsd(box: Sandbox, old: int, timeout: float = 60.0) -> None:
    """Until the supervisor has started a QSD other than `old`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while qsd_pid(box) in (None, old):
        assert asyncio.get_running_loop().time() < deadline, "QSD was not restarted"
        await asyncio.sleep(0.1)


@pytest.fixture
async def block_volume(box: Sandbox, driver: tuple[Driver, CSIClient]) -> tuple[str, BlockDevice]:
    _, csi = driver
    vid = (await csi.create_volume("pvc-cbt", SIZE, block=True)).volume_id
    staging, target = box.staging("cbt"), box.target("cbt")
    await csi.stage(vid, str(staging), block=True)
    await csi.publish(vid, str(staging), str(target), block=True)
    return vid, BlockDevice(target)


async def test_delta_matches_the_truth_through_deletes_crashes_and_flattens(
    box: Sandbox, driver: tuple[Driver, CSIClient], block_volume: tuple[str, BlockDevice],
    caplog: pytest.LogCaptureFixture,
) -> None:
    drv, csi = driver
    vid, dev = block_volume
    dev.write(0, 1 * MIB, 1)
    dev.write(10 * MIB, 256 * KIB, 2)
    dev.cut()
    s0 = (await csi.create_snapshot("cbt-0", vid)).snapshot_id

    # Overwrites, a write straddling a cluster boundary, a discard, new extents.
    dev.write(128 * KIB, 64 * KIB, 3)
    dev.write(5 * MIB - 4 * KIB, 8 * KIB, 4)
    dev.write(20 * MIB + 60 * KIB, 12 * KIB, 5)
    dev.discard(10 * MIB, 128 * KIB)
    dev.write(SIZE - 4 * KIB, 4 * KIB, 6)
    w1 = dev.cut()
    s1 = (await csi.create_snapshot("cbt-1", vid)).snapshot_id
    await check_delta(drv, csi, box, s0, s1, w1)

    # Allocated matches qemu-img map of the snapshot's chain, and covers every non-zero cluster.
    capacity, allocated = await csi.metadata_allocated(s1)
    assert capacity == SIZE
    assert allocated == extents.clip(
        await imagemap.chain_allocation(drv.config.qemu_img, await frozen_image(drv, s1)), 0, SIZE)
    content = await snapshot_content(drv, s1, box.root / "a.raw")
    nonzero = {i for i in range(SIZE // CLUSTER) if content[i * CLUSTER:(i + 1) * CLUSTER].count(0) != CLUSTER}
    assert nonzero <= extents.blocks(allocated, CLUSTER)

    # A snapshot deleted between base and target (hidden: newer images stand on it) keeps the delta exact.
    dev.write(30 * MIB, 64 * KIB, 7)
    w2 = dev.cut()
    s2 = (await csi.create_snapshot("cbt-2", vid)).snapshot_id
    await csi.delete_snapshot(s1)
    dev.write(30 * MIB + 32 * KIB, 4 * KIB, 8)
    dev.write(40 * MIB, 4 * KIB, 9)
    w3 = dev.cut()
    s3 = (await csi.create_snapshot("cbt-3", vid)).snapshot_id
    await check_delta(drv, csi, box, s0, s3, w1 | w2 | w3)
    await check_delta(drv, csi, box, s2, s3, w3)
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await csi.metadata_delta(s1, s3)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND and s1 in (gone.value.details() or "")

    # QSD killed between two snapshots: the images are the record, nothing is lost from the answer.
    dev.write(50 * MIB, 64 * KIB, 10)
    old = qsd_pid(box)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    await new_qsd(box, old)
    await wait_restored(csi, vid, dev.path)
    dev.write(51 * MIB + 4 * KIB, 4 * KIB, 11)
    w4 = dev.cut()
    s4 = (await csi.create_snapshot("cbt-4", vid)).snapshot_id
    await check_delta(drv, csi, box, s3, s4, w4)

    # A live flatten streams everything below s4 into s4's image: s4 stays a boundary. The records of
    # the merged layers go with it, but s4's own was the writable top when QSD was killed: QEMU marks
    # that bitmap inconsistent, so a delta that needs it says so and answers a superset.
    await drv.snapshots.flatten(vid)
    dev.write(60 * MIB, 64 * KIB, 12)
    w5 = dev.cut()
    s5 = (await csi.create_snapshot("cbt-5", vid)).snapshot_id
    await check_delta(drv, csi, box, s4, s5, w5)
    assert drv.changed_blocks.fallbacks == 0
    with caplog.at_level(logging.WARNING, logger="csi_qsd.controller.changed_blocks"):
        superset = await check_delta(drv, csi, box, s3, s5, w4 | w5, exact=False, within_touched=False)
    assert drv.changed_blocks.fallbacks == 1 and "event=cbt_fallback" in caplog.text
    assert "inconsistent" in caplog.text
    assert w4 | w5 <= superset

    # A second live flatten merges s5 and s4 (with the records s4 carries) into s6: deltas from s5 and
    # s4 stay exact through two merges; from s3 the lost record still says so.
    dev.write(62 * MIB, 4 * KIB, 13)
    w6 = dev.cut()
    s6 = (await csi.create_snapshot("cbt-6", vid)).snapshot_id
    await drv.snapshots.flatten(vid)
    dev.write(2 * MIB + 64 * KIB, 128 * KIB, 14)
    w7 = dev.cut()
    s7 = (await csi.create_snapshot("cbt-7", vid)).snapshot_id
    await check_delta(drv, csi, box, s5, s7, w6 | w7)
    await check_delta(drv, csi, box, s4, s7, w5 | w6 | w7)
    assert drv.changed_blocks.fallbacks == 1
    await check_delta(drv, csi, box, s3, s7, w4 | w5 | w6 | w7, exact=False, within_touched=False)
    assert drv.changed_blocks.fallbacks == 2

    # An offline flatten (the volume unstaged) merges into the newest snapshot's image as well.
    dev.write(3 * MIB, 64 * KIB, 15)
    w8 = dev.cut()
    s8 = (await csi.create_snapshot("cbt-8", vid)).snapshot_id
    staging, target = box.staging("cbt"), box.target("cbt")
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
    await drv.snapshots.flatten(vid)
    snapshot8 = await drv.catalog.snapshot(s8)
    assert snapshot8 is not None and snapshot8.backing == ""
    await csi.stage(vid, str(staging), block=True)
    await csi.publish(vid, str(staging), str(target), block=True)
    dev.write(4 * MIB, 4 * KIB, 16)
    w9 = dev.cut()
    s9 = (await csi.create_snapshot("cbt-9", vid)).snapshot_id
    await check_delta(drv, csi, box, s7, s9, w8 | w9)
    await check_delta(drv, csi, box, s6, s9, w7 | w8 | w9)
    await check_delta(drv, csi, box, s5, s9, w6 | w7 | w8 | w9)
    assert drv.changed_blocks.fallbacks == 2

    # Resuming mid-volume and small messages give the same ranges.
    _, whole = await csi.metadata_delta(s0, s3)
    middle = 30 * MIB + 16 * KIB
    _, rest = await csi.metadata_delta(s0, s3, starting_offset=middle, max_results=1)
    assert rest == extents.clip(whole, middle, SIZE)
    call = csi.metadata.GetMetadataDelta(pb.GetMetadataDeltaRequest(
        base_snapshot_id=s0, target_snapshot_id=s3, max_results=2))
    messages = [m async for m in call]
    assert all(len(m.block_metadata) <= 2 and m.block_metadata_type == pb.VARIABLE_LENGTH for m in messages)
    assert len(messages) == (len(whole) + 1) // 2


async def test_an_encrypted_volume_s_deltas_and_allocation_are_exact(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    """Every image of an encrypted volume carries the changed-block record, and its deltas are the truth."""
    drv, csi = driver
    key = "k-" + secrets.token_urlsafe(24)
    vid = (await csi.create_volume("pvc-cbt-enc", SIZE, {"encrypted": "true"}, block=True,
                                   secrets={"key": key})).volume_id
    staging, target = box.staging("cbt-enc"), box.target("cbt-enc")
    await csi.stage(vid, str(staging), block=True, secrets={"key": key})
    await csi.publish(vid, str(staging), str(target), block=True)
    dev = BlockDevice(target)
    for seed, (offset, length) in enumerate([(0, MIB), (10 * MIB, 256 * KIB)], start=1):
        dev.write(offset, length, seed)
    dev.cut()
    s0 = (await csi.create_snapshot("cbt-enc-0", vid)).snapshot_id
    for seed, (offset, length) in enumerate([(128 * KIB, 64 * KIB), (5 * MIB - 4 * KIB, 8 * KIB),
                                             (SIZE - 4 * KIB, 4 * KIB)], start=3):
        dev.write(offset, length, seed)  # overwrites, one straddling a cluster boundary, new extents
    dev.discard(10 * MIB, 128 * KIB)
    w1 = dev.cut()
    s1 = (await csi.create_snapshot("cbt-enc-1", vid)).snapshot_id
    await check_delta(drv, csi, box, s0, s1, w1, key=key)

    # The layer s1 froze holds QSD's record of the same writes, read with the key.
    layer = await frozen_image(drv, s1)
    assert keyed.encrypted(layer)
    (marked,) = await image_bitmaps.read(drv.config.qemu_img, bundled("qemu-nbd"), layer, [layer_bitmaps.OWN],
                                         key=VolumeKey(key))
    assert extents.blocks(marked, CLUSTER) == w1

    # A snapshot deleted between base and target, and a QSD killed: the images stay the record.
    dev.write(30 * MIB, 64 * KIB, 7)
    w2 = dev.cut()
    s2 = (await csi.create_snapshot("cbt-enc-2", vid)).snapshot_id
    await csi.delete_snapshot(s1)
    await crash_qsd(box, csi, vid, dev.path)
    dev.write(40 * MIB + 4 * KIB, 4 * KIB, 9)
    w3 = dev.cut()
    s3 = (await csi.create_snapshot("cbt-enc-3", vid)).snapshot_id
    await check_delta(drv, csi, box, s0, s3, w1 | w2 | w3, key=key)

    # A plaintext NBD export of it is refused, naming the way that keeps it encrypted.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "csi_qsd.cli", "volume", "--endpoint", box.endpoint, "nbd-export", s3,
        "--socket", str(box.root / "enc.nbd"), "--state-dir", str(box.state_dir), stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 1 and b"INVALID_ARGUMENT" in err and b"--key-file" in err, err
    assert not (box.root / "enc.nbd").exists()
    await check_delta(drv, csi, box, s2, s3, w3, key=key)
    assert drv.changed_blocks.fallbacks == 0

    # Allocated is what qemu-img maps of the chain opened with the key, and covers every non-zero cluster.
    capacity, allocated = await csi.metadata_allocated(s3)
    assert capacity == SIZE
    image = await frozen_image(drv, s3)
    _, mapped = await run(drv.config.qemu_img, "map", "--output=json", "--object", keyed.SECRET,
                          keyed.json_name(keyed.chain_spec(image)), stdin=VolumeKey(key).base64().encode())
    assert allocated == extents.clip(extents.parse_map(mapped), 0, SIZE) != []
    content = await snapshot_content(drv, s3, box.root / "a.raw", key)
    nonzero = {i for i in range(SIZE // CLUSTER) if content[i * CLUSTER:(i + 1) * CLUSTER].count(0) != CLUSTER}
    assert nonzero <= extents.blocks(allocated, CLUSTER)

    # Every image of the volume is LUKS and carries its record.
    images = sorted((box.state_dir / "pool").glob(f"{vid}*"))
    assert len(images) >= 3
    for each in images:
        info = (await image_bitmaps.chain_info(drv.config.qemu_img, each))[0]
        assert info["encrypted"] and layer_bitmaps.OWN in image_bitmaps.bitmaps_of(info), each


async def test_errors_name_the_snapshot(box: Sandbox, driver: tuple[Driver, CSIClient],
                                        block_volume: tuple[str, BlockDevice]) -> None:
    _, csi = driver
    vid, dev = block_volume
    s0 = (await csi.create_snapshot("err-0", vid)).snapshot_id
    dev.write(0, 4 * KIB, 1)
    s1 = (await csi.create_snapshot("err-1", vid)).snapshot_id
    other = (await csi.create_volume("pvc-other", SIZE)).volume_id
    o0 = (await csi.create_snapshot("err-o", other)).snapshot_id
    unknown = "snap-" + "0" * 24

    async def code(call: object) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call  # type: ignore[misc]
        return error.value.code(), error.value.details() or ""

    assert await code(csi.metadata_allocated(unknown)) == (grpc.StatusCode.NOT_FOUND, f"snapshot {unknown} does not exist")
    c, m = await code(csi.metadata_delta(s0, unknown))
    assert c == grpc.StatusCode.NOT_FOUND and unknown in m
    c, m = await code(csi.metadata_delta(s0, o0))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and s0 in m and o0 in m
    for base, target in ((s1, s0), (s0, s0)):
        c, m = await code(csi.metadata_delta(base, target))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and "older" in m
    c, m = await code(csi.metadata_delta(s0, s1, starting_offset=SIZE + 1))
    assert c == grpc.StatusCode.OUT_OF_RANGE and "starting_offset" in m
    c, _ = await code(csi.metadata_allocated(s0, starting_offset=-1))
    assert c == grpc.StatusCode.OUT_OF_RANGE
    c, m = await code(csi.metadata_delta(s0, s1, max_results=-1))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "max_results" in m
    c, m = await code(csi.metadata_delta("", s1))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "base_snapshot_id" in m
    # An empty answer still tells the capacity; an unchanged volume has an empty delta.
    s2 = (await csi.create_snapshot("err-2", vid)).snapshot_id
    assert await csi.metadata_delta(s1, s2) == (SIZE, [])
    assert await csi.metadata_delta(s1, s2, starting_offset=SIZE) == (SIZE, [])
    caps = await csi.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
    services = {c.service.type for c in caps.capabilities if c.HasField("service")}
    assert pb.PluginCapability.Service.SNAPSHOT_METADATA_SERVICE in services
    await asyncio.sleep(0)


async def test_a_snapshot_served_over_nbd_reads_as_the_snapshot_with_its_changed_blocks(
    box: Sandbox, driver: tuple[Driver, CSIClient], block_volume: tuple[str, BlockDevice],
) -> None:
    """`csi-qsd volume nbd-export`: what a backup tool pulls over NBD is the snapshot and its record."""
    drv, csi = driver
    vid, dev = block_volume
    dev.write(0, 256 * KIB, 1)
    dev.cut()
    s0 = (await csi.create_snapshot("nbd-0", vid)).snapshot_id
    dev.write(3 * MIB + 60 * KIB, 8 * KIB, 2)
    dev.write(40 * MIB, 64 * KIB, 3)
    w1 = dev.cut()
    s1 = (await csi.create_snapshot("nbd-1", vid)).snapshot_id
    dev.write(41 * MIB, 64 * KIB, 4)  # after the snapshot: not in what is served
    socket = box.root / "s1.nbd"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "csi_qsd.cli", "volume", "--endpoint", box.endpoint, "nbd-export", s1,
        "--socket", str(socket), "--state-dir", str(box.state_dir), "--qemu-img", drv.config.qemu_img,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        told = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert told["uri"] == f"nbd+unix:///?socket={socket}"
        assert "qemu:dirty-bitmap:cbt" in told["contexts"] and "qemu:allocation-depth" in told["contexts"]
        served = box.root / "served.raw"
        await run(drv.config.qemu_img, "convert", "-f", "raw", "-O", "raw", told["uri"], str(served))
        assert served.read_bytes() == await snapshot_content(drv, s1, box.root / "s1.raw")
        served.unlink()
        opts = f"driver=nbd,server.type=unix,server.path={socket},x-dirty-bitmap=qemu:dirty-bitmap:cbt"
        _, out = await run(drv.config.qemu_img, "map", "--output=json", "--image-opts", opts)
        dirty = [(e["start"], e["length"]) for e in json.loads(out) if not e["data"]]
        assert extents.blocks(dirty, CLUSTER) == w1
        _, delta = await csi.metadata_delta(s0, s1)
        assert extents.coalesce(dirty) == delta
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert not socket.exists()


async def test_nbd_export_of_an_unknown_snapshot_says_so(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "csi_qsd.cli", "volume", "--endpoint", box.endpoint, "nbd-export",
        "snap-000000000000000000000000", "--socket", str(box.root / "x.nbd"), "--state-dir", str(box.state_dir),
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 1 and b"NOT_FOUND" in err and b"snap-000000000000000000000000" in err
