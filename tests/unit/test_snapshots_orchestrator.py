"""Snapshots (`Snapshots`, `LiveImages`) over doubles: a live cut where a volume is staged, none where not.

QSD, the pool and the export kind are `tests.fakes`; the catalog is real.
What QEMU does with the images is the integration tier's
(`tests/integration/test_snapshots.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd.catalog import SnapshotState, VolumeRecord
from csi_qsd.errors import AlreadyExists, FailedPrecondition, QSDError, Unavailable
from csi_qsd.node.staging import StageSpec
from csi_qsd.qsd import graph
from tests.fakes import Crash, CrashAt, FakeDaemon, FakeHostState, FakeNode, fake_node


@pytest.fixture
async def f(tmp_path: Path) -> AsyncIterator[FakeNode]:
    async with fake_node(tmp_path) as node:
        yield node


async def staged(f: FakeNode, volume: VolumeRecord) -> None:
    await f.node.stage(StageSpec(volume.id, Path(f"/staging/{volume.name}"), False, "", ()))


def top(volume: VolumeRecord, generation: int) -> str:
    return graph.nodes_for(volume.id, generation).format


async def unchanged(f: FakeNode, volume: VolumeRecord) -> None:
    """Nothing of a refused cut is left: no snapshot row, no overlay, the volume where it was."""
    assert await f.catalog.snapshots() == []
    assert await f.catalog.volume(volume.id) == volume
    assert volume.image in f.pool.images() and f.pool.image_path(volume.id, volume.params.format, 1) not in \
        f.pool.images()


async def test_a_snapshot_of_a_staged_volume_switches_its_top_live_while_the_consumer_is_held(f: FakeNode) -> None:
    volume = await f.new_volume()
    await staged(f, volume)
    seen: list[tuple[str, str | None]] = []

    def note(step: str) -> None:
        async def look() -> None:
            seen.append((step, f.client().reads(volume.id)))
        f.kind.at(step, look)

    note("quiesce")
    note("thaw")
    snapshot = await f.snapshots.create("snap-a", volume.id)

    assert seen == [("quiesce", top(volume, 0)), ("thaw", top(volume, 1))]
    assert f.client().commands().count("transaction") == 1
    assert f.client().nodes[top(volume, 1)]["backing"] == top(volume, 0)
    moved = await f.catalog.volume(volume.id)
    assert moved is not None and moved.generation == 1 and moved.backing == str(volume.image)
    assert snapshot.image == volume.image and snapshot.state is SnapshotState.READY
    assert await f.pool.backing_of(moved.image) == str(volume.image)


async def test_a_snapshot_of_an_unstaged_volume_asks_nothing_of_qsd(f: FakeNode) -> None:
    volume = await f.new_volume()
    await f.snapshots.create("snap-a", volume.id)

    assert f.client().calls == [] and f.kind.calls == []
    moved = await f.catalog.volume(volume.id)
    assert moved is not None and moved.generation == 1 and moved.backing == str(volume.image)


async def test_a_snapshot_is_idempotent_by_name(f: FakeNode) -> None:
    volume, other = await f.new_volume(), await f.new_volume("pvc-2")
    await staged(f, volume)
    first = await f.snapshots.create("snap-a", volume.id)

    assert await f.snapshots.create("snap-a", volume.id) == first
    with pytest.raises(AlreadyExists, match=f"snapshot 'snap-a' exists \\({first.id}\\) of another volume"):
        await f.snapshots.create("snap-a", other.id)
    assert f.client().commands().count("transaction") == 1 and len(await f.catalog.snapshots()) == 1


async def test_a_snapshot_while_the_volumes_qsd_is_not_ready_is_unavailable_and_leaves_nothing(f: FakeNode) -> None:
    volume = await f.new_volume()
    await staged(f, volume)
    f.daemons[0].ready = False

    with pytest.raises(Unavailable, match="not ready"):
        await f.snapshots.create("snap-a", volume.id)

    await unchanged(f, volume)


async def test_a_switch_qsd_refuses_is_undone(f: FakeNode) -> None:
    volume = await f.new_volume()
    await staged(f, volume)
    f.client().fail_next("transaction")

    with pytest.raises(QSDError, match="transaction"):
        await f.snapshots.create("snap-a", volume.id)

    await unchanged(f, volume)
    assert f.client().reads(volume.id) == top(volume, 0)
    assert not {n for n in f.client().nodes if (p := graph.parse_name(n)) and p.generation == 1}
    assert f.kind.state.frozen == set()


async def test_a_switch_whose_answer_was_lost_rolls_forward(f: FakeNode) -> None:
    volume = await f.new_volume()
    await staged(f, volume)
    f.client().fail_next("transaction", answer_lost=True)

    snapshot = await f.snapshots.create("snap-a", volume.id)

    assert snapshot.state is SnapshotState.READY and f.client().reads(volume.id) == top(volume, 1)
    moved = await f.catalog.volume(volume.id)
    assert moved is not None and moved.generation == 1


async def test_a_consumer_that_cannot_be_held_still_stops_the_cut_before_qsd_sees_it(f: FakeNode) -> None:
    volume = await f.new_volume()
    await staged(f, volume)
    f.kind.fail_at("quiesce", FailedPrecondition("fsfreeze: the filesystem is busy"))

    with pytest.raises(FailedPrecondition, match="fsfreeze"):
        await f.snapshots.create("snap-a", volume.id)

    await unchanged(f, volume)
    assert "transaction" not in f.client().commands()


# groups -----------------------------------------------------------------


async def test_a_group_staged_across_shards_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    async with fake_node(tmp_path, shards=2) as f:
        one, two = await f.new_volume("a", namespace="one"), await f.new_volume("b", namespace="two")
        for volume in (one, two):
            await staged(f, volume)
        assert {s.shard for s in await f.catalog.stages()} == {0, 1}, "the namespaces must land on both shards"
        changes = [f.client(shard).changes() for shard in (0, 1)]

        with pytest.raises(FailedPrecondition, match=f"volumes {one.id}, {two.id} are staged on different"):
            await f.snapshots.create_group("group-a", [one.id, two.id])

        assert await f.catalog.group(name="group-a") is None
        for volume in (one, two):
            await unchanged(f, volume)
        assert [f.client(shard).changes() for shard in (0, 1)] == changes and not f.kind.called("quiesce")


async def test_a_group_on_one_shard_is_cut_in_one_transaction(tmp_path: Path) -> None:
    async with fake_node(tmp_path, shards=2) as f:
        one, two = await f.new_volume("a", namespace="one"), await f.new_volume("b", namespace="one")
        unstaged = await f.new_volume("c", namespace="two")
        for volume in (one, two):
            await staged(f, volume)
        shard = (await f.catalog.stages())[0].shard

        group = await f.snapshots.create_group("group-a", [one.id, two.id, unstaged.id])

        transactions = [args for name, args in f.client(shard).calls if name == "transaction"]
        assert len(transactions) == 1 and len(transactions[0]["actions"]) == 2
        assert {s.source_volume_id for s in group.members} == {one.id, two.id, unstaged.id}
        for volume in (one, two):
            assert f.client(shard).reads(volume.id) == top(volume, 1)


# crashes ------------------------------------------------------------------


@pytest.mark.parametrize("point, forward", [("snapshot.after_intent", False), ("snapshot.after_switch", True)])
async def test_a_cut_a_crash_cut_off_is_rolled_forward_or_back_by_the_restart(
    tmp_path: Path, point: str, forward: bool,
) -> None:
    daemons, host = [FakeDaemon()], FakeHostState()
    async with fake_node(tmp_path, daemons=daemons, state=host, failpoints=CrashAt(point)) as f:
        volume = await f.new_volume()
        await staged(f, volume)
        with pytest.raises(Crash):
            await f.snapshots.create("snap-a", volume.id)

    async with fake_node(tmp_path, daemons=daemons, state=host) as f:  # reconciles the snapshots
        await f.rebuild()

        snapshots = await f.catalog.snapshots()
        moved = await f.catalog.volume(volume.id)
        assert moved is not None
        if forward:
            assert [(s.name, s.state, s.overlay) for s in snapshots] == [("snap-a", SnapshotState.READY, "")]
            assert moved.generation == 1 and f.client().reads(volume.id) == top(volume, 1)
        else:
            await unchanged(f, volume)
            assert f.client().reads(volume.id) == top(volume, 0)
