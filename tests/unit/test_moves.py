"""Moving a staged volume to a new home to grow it (`csi_qsd.node.moves`), over doubles.

A move that fails is undone before its commit and finished after it; a
crash anywhere is settled the same way by the restart, before anything
else touches the volume. The pool keeps its homes in the real catalog,
QSD and the export kind are `tests.fakes`; copying real bytes under a
running consumer is the integration tier's
(`tests/integration/test_device_pool_moves.py`, `test_device_pool_move_crash.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd.catalog import ExtentState, VolumeRecord
from csi_qsd.errors import QSDError
from csi_qsd.node.staging import StageSpec
from csi_qsd.params import ImageFormat
from csi_qsd.qsd import graph
from tests.fakes import Crash, FakeDaemon, FakeHostState, FakeNode, fake_node

MIB = 1 << 20
STAGING = Path("/staging/a")


@pytest.fixture
async def f(tmp_path: Path) -> AsyncIterator[FakeNode]:
    async with fake_node(tmp_path) as node:
        yield node


async def staged_volume(f: FakeNode) -> VolumeRecord:
    """A 32 MiB volume of the moving pool, staged, in home 0."""
    volume = await f.new_volume("a", 32 * MIB, format=ImageFormat.RAW, pool=f.moving_pool.id)
    await f.node.stage(StageSpec(volume.id, STAGING, False, "", ()))
    f.kind.calls.clear()
    return volume


async def settled(f: FakeNode, volume: VolumeRecord, *, generation: int, capacity: int = 32 * MIB) -> None:
    """The volume reads one home, the one the catalog names, and nothing of a move is left."""
    row = await f.catalog.volume(volume.id)
    assert row is not None and (row.generation, row.capacity) == (generation, capacity)
    assert f.moving_pool.homes(volume.id) == {ExtentState.USED: generation}
    assert f.moving_pool.moves_under_way() == {}
    client = f.client()
    assert client.reads(volume.id) == graph.nodes_for(volume.id, generation).format
    assert {p.generation for n in client.volume_nodes(volume.id) if (p := graph.parse_name(n))} - {None} == {generation}
    assert client.nodes[graph.nodes_for(volume.id, generation).file]["filename"].endswith(f"@{generation}")
    assert f.kind.state.frozen == set()


async def test_a_volume_without_room_where_it_is_moves_live_then_grows(f: FakeNode) -> None:
    volume = await staged_volume(f)

    assert await f.node.expand(volume.id, STAGING, 48 * MIB, 0) == 48 * MIB

    await settled(f, volume, generation=1, capacity=48 * MIB)
    assert [c.method for c in f.kind.calls] == ["check_move", "move", "quiesce", "thaw", "release", "expand"]
    assert f.kind.state.sizes == {volume.id: 48 * MIB}


async def test_a_volume_with_room_where_it_is_grows_there(f: FakeNode) -> None:
    volume = await staged_volume(f)
    f.moving_pool.room_in_place = True

    await f.node.expand(volume.id, STAGING, 48 * MIB, 0)

    await settled(f, volume, generation=0, capacity=48 * MIB)
    assert [c.method for c in f.kind.calls] == ["expand"]


@pytest.mark.parametrize("step", ["move.copied", "move.held"])
async def test_a_move_failing_before_qsd_switched_is_undone(f: FakeNode, step: str) -> None:
    volume = await staged_volume(f)
    f.kind.fail_at(step, QSDError("blockdev-backup: job failed"))

    with pytest.raises(QSDError, match="blockdev-backup"):
        await f.node.expand(volume.id, STAGING, 48 * MIB, 0)

    await settled(f, volume, generation=0)
    assert not f.kind.called("expand")


async def test_a_move_failing_once_qsd_switched_is_finished_and_the_retry_grows_in_place(f: FakeNode) -> None:
    volume = await staged_volume(f)
    f.kind.fail_at("move.switched", QSDError("the answer to blockdev-reopen was lost"))

    with pytest.raises(QSDError):
        await f.node.expand(volume.id, STAGING, 48 * MIB, 0)
    await settled(f, volume, generation=1)  # QSD reads the new home: that is the truth now

    await f.node.expand(volume.id, STAGING, 48 * MIB, 0)
    await settled(f, volume, generation=1, capacity=48 * MIB)
    assert len(f.kind.called("move")) == 1


@pytest.mark.parametrize("commits_before_switch, point, committed", [
    (False, "move.copied", False),
    (False, "move.held", False),  # the filesystem stays frozen until the restart releases it
    (False, "move.switched", True),  # QSD switched, the commit was not made: QSD's graph is the truth
    (False, "move.committed", True),
    (True, "move.committed", True),  # committed, not yet switched (a mirror's order): the restart switches
])
async def test_a_move_a_crash_cut_off_is_settled_by_the_restart(
    tmp_path: Path, commits_before_switch: bool, point: str, committed: bool,
) -> None:
    daemons, host = [FakeDaemon()], FakeHostState()
    async with fake_node(tmp_path, daemons=daemons, state=host, commits_before_switch=commits_before_switch) as f:
        volume = await staged_volume(f)
        f.kind.fail_at(point, Crash(point))
        with pytest.raises(Crash):
            await f.node.expand(volume.id, STAGING, 48 * MIB, 0)
        assert f.moving_pool.moves_under_way() == {volume.id: point == "move.committed"}

    async with fake_node(tmp_path, daemons=daemons, state=host, commits_before_switch=commits_before_switch) as f:
        await f.rebuild()

        await settled(f, volume, generation=int(committed))
        assert f.kind.calls[0].method == "release"  # before anything else touches the volume
        assert bool(f.kind.called("finish_move")) == commits_before_switch
