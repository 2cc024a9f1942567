"""Snapshots, restores, clones and group snapshots on a real QSD, cut live under mounted volumes."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import grpc
import pytest

from csi_qsd.catalog import VolumeRecord
from csi_qsd.cli.client import CSIClient
from csi_qsd.controller import chains
from csi_qsd.controller.snapshots import MAX_CHAIN_DEPTH
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.server import Driver
from testing.harness import DriverProcess, Sandbox, until, write_synced

MIB = 1 << 20



class Mounted:
    """A volume staged and published as a filesystem in the sandbox."""

    def __init__(self, box: Sandbox, csi: CSIClient, vid: str, tag: str) -> None:
        self.box, self.csi, self.vid = box, csi, vid
        self.staging, self.target = box.staging(tag), box.target(tag)

    async def __aenter__(self) -> Path:
        await self.csi.stage(self.vid, str(self.staging))
        await self.csi.publish(self.vid, str(self.staging), str(self.target))
        return self.target

    async def __aexit__(self, *exc: object) -> None:
        await self.csi.unpublish(self.vid, str(self.target))
        await self.csi.unstage(self.vid, str(self.staging))


def pool_files(box: Sandbox) -> list[str]:
    return sorted(p.name for p in (box.state_dir / "pool").iterdir())


async def test_snapshot_of_mounted_volume_restores_byte_for_byte(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    vid = (await csi.create_volume("pvc-src", 96 * MIB)).volume_id
    before = os.urandom(5 * MIB)
    async with Mounted(box, csi, vid, "src") as mount:
        write_synced(mount / "data", before)
        snapshot = await csi.create_snapshot("snap-1", vid)
        assert snapshot.ready_to_use and snapshot.size_bytes == 96 * MIB and snapshot.source_volume_id == vid
        assert abs(snapshot.creation_time.seconds - __import__("time").time()) < 60
        write_synced(mount / "data", os.urandom(5 * MIB))  # the live volume moves on
        write_synced(mount / "later", b"after the snapshot")
        again = await csi.create_snapshot("snap-1", vid)
        assert again.snapshot_id == snapshot.snapshot_id
        restored = (await csi.create_volume("pvc-restore", 96 * MIB, from_snapshot=snapshot.snapshot_id)).volume_id
        async with Mounted(box, csi, restored, "restore") as copy:
            assert (copy / "data").read_bytes() == before
            assert not (copy / "later").exists()
        assert (mount / "later").read_bytes() == b"after the snapshot"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await csi.create_snapshot("snap-1", restored)
    assert info.value.code() is grpc.StatusCode.ALREADY_EXISTS and "snap-1" in (info.value.details() or "")


async def test_clone_of_volume_in_use(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    vid = (await csi.create_volume("pvc-live", 64 * MIB)).volume_id
    async with Mounted(box, csi, vid, "live") as mount:
        write_synced(mount / "a", b"cloned content")
        clone = await csi.create_volume("pvc-clone", 128 * MIB, from_volume=vid)
        assert clone.capacity_bytes == 128 * MIB
        assert clone.content_source.volume.volume_id == vid
        write_synced(mount / "a", b"changed after clone")
        async with Mounted(box, csi, clone.volume_id, "clone") as copy:
            assert (copy / "a").read_bytes() == b"cloned content"
            assert os.statvfs(copy).f_blocks * os.statvfs(copy).f_frsize > 100 * MIB  # grown to the new size
        assert (mount / "a").read_bytes() == b"changed after clone"
    assert await csi.list_snapshots() == []  # the clone's internal snapshot is not the user's


async def test_source_deleted_before_its_snapshot(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    vid = (await csi.create_volume("pvc-gone", 64 * MIB)).volume_id
    async with Mounted(box, csi, vid, "gone") as mount:
        write_synced(mount / "keep", b"outlives its volume")
    snapshot = await csi.create_snapshot("snap-outlives", vid)
    await csi.delete_volume(vid)
    assert [s.snapshot_id for s in await csi.list_snapshots()] == [snapshot.snapshot_id]
    restored = (await csi.create_volume("pvc-back", 64 * MIB, from_snapshot=snapshot.snapshot_id)).volume_id
    async with Mounted(box, csi, restored, "back") as copy:
        assert (copy / "keep").read_bytes() == b"outlives its volume"
    await csi.delete_volume(restored)
    await csi.delete_snapshot(snapshot.snapshot_id)
    await until(lambda: pool_files(box) == [], "the deleted volumes' storage to be freed", 10)


async def test_delete_snapshot_during_a_restore_from_it(
    box: Sandbox, driver: tuple[Driver, CSIClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeleteSnapshot racing a restore never removes the image the restore is about to stand on.

    The restore is held just before it records its volume (the window in
    which the snapshot has no dependants yet) until the delete has answered.
    """
    drv, csi = driver
    vid = (await csi.create_volume("pvc-race", 64 * MIB)).volume_id
    async with Mounted(box, csi, vid, "race") as mount:
        write_synced(mount / "f", b"restored despite the delete")
    snapshot = await csi.create_snapshot("snap-race", vid)
    await csi.delete_volume(vid)  # the snapshot is now the only thing holding its image
    entered, release = asyncio.Event(), asyncio.Event()
    real_add = drv.catalog.add_volume

    async def held_add(record: VolumeRecord, *, durable: bool = True) -> None:
        if record.name == "pvc-raced":
            entered.set()
            await release.wait()
        await real_add(record, durable=durable)

    monkeypatch.setattr(drv.catalog, "add_volume", held_add)
    restore = asyncio.create_task(csi.create_volume("pvc-raced", 64 * MIB, from_snapshot=snapshot.snapshot_id))
    await asyncio.wait_for(entered.wait(), 30)
    try:
        await csi.delete_snapshot(snapshot.snapshot_id)
        deleted = True
    except grpc.aio.AioRpcError as exc:
        assert exc.code() is grpc.StatusCode.ABORTED, exc
        assert snapshot.snapshot_id in str(exc.details())
        deleted = False
    release.set()
    restored = (await restore).volume_id
    async with Mounted(box, csi, restored, "raced") as copy:
        assert (copy / "f").read_bytes() == b"restored despite the delete"
    if not deleted:
        await csi.delete_snapshot(snapshot.snapshot_id)  # the CO's retry: now hidden behind the restore
    assert await csi.list_snapshots() == []
    await csi.delete_volume(restored)
    await until(lambda: pool_files(box) == [], "the deleted volumes' storage to be freed", 10)


async def test_snapshot_deleted_before_its_clone(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    vid = (await csi.create_volume("pvc-base", 64 * MIB)).volume_id
    async with Mounted(box, csi, vid, "base") as mount:
        write_synced(mount / "f", b"snapshot content")
    snapshot = await csi.create_snapshot("snap-hide", vid)
    restored = (await csi.create_volume("pvc-child", 64 * MIB, from_snapshot=snapshot.snapshot_id)).volume_id
    await csi.delete_snapshot(snapshot.snapshot_id)
    assert await csi.list_snapshots() == []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await csi.controller.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=snapshot.snapshot_id))
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    await csi.delete_snapshot(snapshot.snapshot_id)  # idempotent
    async with Mounted(box, csi, restored, "child") as copy:
        assert (copy / "f").read_bytes() == b"snapshot content"
    hidden_image = f"{vid}.qcow2"
    assert hidden_image in pool_files(box)
    await csi.delete_volume(vid)
    assert hidden_image in pool_files(box), "the clone still reads through the hidden snapshot"
    await csi.delete_volume(restored)
    await until(lambda: pool_files(box) == [], "the last dependant to take the hidden snapshot with it", 10)


async def snapshot_as_a_co_does(csi: CSIClient, name: str, volume_id: str) -> pb.Snapshot:
    """CreateSnapshot, retried on ABORTED like the external-snapshotter: a background flatten may hold the volume."""
    for _ in range(100):
        try:
            return await csi.create_snapshot(name, volume_id)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError(f"CreateSnapshot {name} stayed ABORTED for 10 s")


async def test_deep_chains_are_flattened_live(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    """Past MAX_CHAIN_DEPTH the chain is flattened in the background while the volume stays mounted."""
    drv, csi = driver
    vid = (await csi.create_volume("pvc-deep", 64 * MIB)).volume_id
    snaps = []
    async with Mounted(box, csi, vid, "deep") as mount:
        for i in range(MAX_CHAIN_DEPTH + 1):
            write_synced(mount / f"file{i}", f"generation {i}".encode() * 1000)
            snaps.append((await snapshot_as_a_co_does(csi, f"deep-{i}", vid)).snapshot_id)
        depths: list[int] = []

        async def flattened() -> bool:
            record = await drv.catalog.volume(vid)
            assert record is not None
            depths.append(await chains.depth(drv.catalog, record))
            return depths[-1] <= 3

        # The flatten starts once the chain passes MAX_CHAIN_DEPTH: before the last snapshot (which then
        # waits for it and adds one layer: depth 3) or after it (depth 2), as the event loop has it.
        await until(flattened, lambda: f"block-stream to flatten the chain under the mounted volume "
                    f"(depth {depths[-1] if depths else '?'})", timeout=60, interval=0.1)
        assert depths[-1] in (2, 3), "block-stream must have flattened the chain under the mounted volume"
        write_synced(mount / "during", b"the volume stayed writable")
        for i in range(MAX_CHAIN_DEPTH + 1):
            assert (mount / f"file{i}").read_bytes() == f"generation {i}".encode() * 1000
    # Every snapshot still restores to exactly what it held.
    restored = (await csi.create_volume("pvc-deep-r", 64 * MIB, from_snapshot=snaps[3])).volume_id
    async with Mounted(box, csi, restored, "deep-r") as copy:
        assert sorted(p.name for p in copy.iterdir() if p.name.startswith("file")) == [f"file{i}" for i in range(4)]
    await csi.delete_volume(restored)
    for snapshot_id in snaps:
        await csi.delete_snapshot(snapshot_id)
    await drv.volumes.freed()  # the restored copy's storage goes in the background, and with it the chain it held
    record = await drv.catalog.volume(vid)
    assert record is not None
    below = await chains.from_backing(drv.catalog, record.backing)
    assert len(below) == depths[-1] - 1, "deleting the snapshots left the volume's chain as it was"
    assert pool_files(box) == sorted([record.image.name, *(p.name for p in below)])
    async with Mounted(box, csi, vid, "deep2") as mount:
        for i in range(MAX_CHAIN_DEPTH + 1):
            assert (mount / f"file{i}").read_bytes() == f"generation {i}".encode() * 1000
        assert (mount / "during").read_bytes() == b"the volume stayed writable"
    await csi.delete_volume(vid)
    await until(lambda: pool_files(box) == [], "the deleted volumes' storage to be freed", 10)


async def test_group_snapshot_cuts_all_members_at_one_instant(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    vids = [(await csi.create_volume(f"pvc-g{i}", 16 * MIB, block=True)).volume_id for i in range(3)]
    targets = []
    for i, vid in enumerate(vids):
        staging, target = box.staging(f"g{i}"), box.target(f"g{i}")
        await csi.stage(vid, str(staging), block=True)
        await csi.publish(vid, str(staging), str(target), block=True)
        targets.append((staging, target))
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:
        """Sequence numbers spread round-robin over the volumes, each durable before the next."""
        fds = [os.open(t, os.O_RDWR | os.O_DIRECT) for _, t in targets]
        block = bytearray(4096)
        try:
            seq = 0
            while not stop.is_set() and seq < 3000:
                buf = memoryview(__import__("mmap").mmap(-1, 4096))
                buf[:8] = (seq + 1).to_bytes(8, "little")
                os.pwrite(fds[seq % 3], buf, (seq // 3) * 4096)
                os.fsync(fds[seq % 3])
                written.append(seq)
                seq += 1
        finally:
            for fd in fds:
                os.close(fd)
        del block

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        # Cut while the writer is well under way, and let it write on after the cut.
        await until(lambda: len(written) >= 60 or not thread.is_alive(), "the writer's first 60 writes")
        group = await csi.create_group_snapshot("group-1", vids)
        at_cut = len(written)
        await until(lambda: len(written) >= at_cut + 60 or not thread.is_alive(), "60 writes after the cut")
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
    assert len(group.snapshots) == 3 and {s.group_snapshot_id for s in group.snapshots} == {group.group_snapshot_id}
    assert len(written) > 20
    for vid, (staging, target) in zip(vids, targets):
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))

    present: set[int] = set()
    for member in group.snapshots:
        index = vids.index(member.source_volume_id)
        restored = (await csi.create_volume(f"pvc-r{index}", 16 * MIB, block=True,
                                            from_snapshot=member.snapshot_id)).volume_id
        staging, target = box.staging(f"r{index}"), box.target(f"r{index}")
        await csi.stage(restored, str(staging), block=True)
        await csi.publish(restored, str(staging), str(target), block=True)
        data = target.read_bytes()
        for slot in range(len(data) // 4096):
            value = int.from_bytes(data[slot * 4096:slot * 4096 + 8], "little")
            if value:
                assert value - 1 == slot * 3 + index
                present.add(value - 1)
        await csi.unpublish(restored, str(target))
        await csi.unstage(restored, str(staging))
    cut = len(present)
    assert 0 < cut < len(written), "the cut must fall inside the write sequence"
    assert present == set(range(cut)), "every write before the cut, on every member, and none after"


async def test_list_snapshots_filters_and_pages(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    a = (await csi.create_volume("pvc-la", 16 * MIB)).volume_id
    b = (await csi.create_volume("pvc-lb", 16 * MIB)).volume_id
    made = [await csi.create_snapshot(f"ls-{i}", a if i % 2 else b) for i in range(5)]
    assert {s.snapshot_id for s in await csi.list_snapshots()} == {s.snapshot_id for s in made}
    assert {s.source_volume_id for s in await csi.list_snapshots(source_volume_id=a)} == {a}
    assert len(await csi.list_snapshots(source_volume_id=a)) == 2
    one = await csi.list_snapshots(snapshot_id=made[3].snapshot_id)
    assert [s.snapshot_id for s in one] == [made[3].snapshot_id]
    page = await csi.controller.ListSnapshots(pb.ListSnapshotsRequest(max_entries=2))
    assert len(page.entries) == 2 and page.next_token
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await csi.controller.ListSnapshots(pb.ListSnapshotsRequest(starting_token="bogus"))
    assert info.value.code() is grpc.StatusCode.ABORTED


@pytest.mark.parametrize("point", ["snapshot.after_intent", "snapshot.after_overlay", "snapshot.after_switch"])
async def test_crash_inside_snapshot_steps(box: Sandbox, process: DriverProcess, point: str) -> None:
    async with CSIClient(box.endpoint, timeout=60) as csi:
        vid = (await csi.create_volume("pvc-sc", 64 * MIB)).volume_id
        staging, target = box.staging("sc"), box.target("sc")
        await csi.stage(vid, str(staging))
        await csi.publish(vid, str(staging), str(target))
        write_synced(target / "before", b"written before the snapshot")
        await process.stop()
        await process.start(failpoints=point)
        with pytest.raises(grpc.aio.AioRpcError):
            await csi.create_snapshot("snap-crash", vid)
        await process.wait_exit()
        await process.start()
        # The mount still works and holds the data; the chain on disk is whole.
        assert (target / "before").read_bytes() == b"written before the snapshot"
        write_synced(target / "after", b"written after the crash")
        snapshot = await csi.create_snapshot("snap-crash", vid)  # the CO's retry
        restored = (await csi.create_volume("pvc-scr", 64 * MIB, from_snapshot=snapshot.snapshot_id)).volume_id
        async with Mounted(box, csi, restored, "scr") as copy:
            assert (copy / "before").read_bytes() == b"written before the snapshot"
        await csi.delete_volume(restored)
        await csi.delete_snapshot(snapshot.snapshot_id)
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        async with Mounted(box, csi, vid, "sc2") as mount:
            assert (mount / "after").read_bytes() == b"written after the crash"
        await csi.delete_volume(vid)
        await until(lambda: pool_files(box) == [], "the deleted volumes' storage to be freed", 10)


async def test_crash_inside_snapshot_delete(box: Sandbox, process: DriverProcess) -> None:
    async with CSIClient(box.endpoint, timeout=60) as csi:
        vid = (await csi.create_volume("pvc-sd", 64 * MIB)).volume_id
        snapshot_id = (await csi.create_snapshot("snap-sd", vid)).snapshot_id
        await csi.delete_volume(vid)  # nothing depends on the snapshot any more
        await process.stop()
        await process.start(failpoints="delete_snapshot.after_intent")
        with pytest.raises(grpc.aio.AioRpcError):
            await csi.delete_snapshot(snapshot_id)
        await process.wait_exit()
        await process.start()
        assert await csi.list_snapshots() == []
        await until(lambda: pool_files(box) == [], "the deleted volumes' storage to be freed", 10)
        await csi.delete_snapshot(snapshot_id)  # the CO's retry


async def test_refused_clone_leaves_the_source_uncut(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    """A clone request that fails its checks must not cut the source first (the CO retries forever)."""
    drv, csi = driver
    vid = (await csi.create_volume("pvc-origin", 64 * MIB)).volume_id
    before = pool_files(box)
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await csi.create_volume("pvc-too-small", 32 * MIB, from_volume=vid)
        assert info.value.code() is grpc.StatusCode.OUT_OF_RANGE
    assert pool_files(box) == before
    record = await drv.catalog.volume(vid)
    assert record is not None and record.generation == 0 and record.backing == ""


@pytest.mark.parametrize("point", ["create.after_intent", "create.after_image"])
async def test_crash_inside_a_clone(box: Sandbox, process: DriverProcess, point: str) -> None:
    """A clone cut short: no half-made clone survives, the source's chain is whole, the retry works."""
    async with CSIClient(box.endpoint, timeout=60) as csi:
        vid = (await csi.create_volume("pvc-cs", 64 * MIB)).volume_id
        async with Mounted(box, csi, vid, "cs") as mount:
            write_synced(mount / "f", b"cloned bytes")
        await process.stop()
        await process.start(failpoints=point)
        with pytest.raises(grpc.aio.AioRpcError):
            await csi.create_volume("pvc-cs-clone", 64 * MIB, from_volume=vid)
        await process.wait_exit()
        await process.start()
        assert [v.volume_id for v in await csi.list_volumes()] == [vid]
        assert await csi.list_snapshots() == []
        clone = (await csi.create_volume("pvc-cs-clone", 64 * MIB, from_volume=vid)).volume_id  # the retry
        async with Mounted(box, csi, clone, "csc") as copy:
            assert (copy / "f").read_bytes() == b"cloned bytes"
        async with Mounted(box, csi, vid, "cs2") as mount:
            assert (mount / "f").read_bytes() == b"cloned bytes"
        await csi.delete_volume(clone)
        await csi.delete_volume(vid)
        await until(lambda: pool_files(box) == [], "the interrupted clone's cut to leak no image", 10)
