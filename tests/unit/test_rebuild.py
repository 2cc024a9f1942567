"""The graph rebuild (`GraphRebuild`) over doubles: what a crash left is finished or undone from the catalog.

Each driver "restart" is a new `fake_node` over the same catalog file, QSD
daemons and host state; a QSD restart is a fake QSD with an empty graph.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from csi_qsd.catalog import StageState, VolumeRecord
from csi_qsd.node.staging import PublishSpec, StageSpec
from csi_qsd.params import VolumeParameters
from csi_qsd.qsd import graph
from csi_qsd.qsd.storage import ImageFile
from tests.fakes import Crash, CrashAt, FakeDaemon, FakeHostState, FakeNode, fake_node

STRAY = "vol-0000000000000000000000ff"  # a volume the catalog does not know


def stage_of(volume: VolumeRecord) -> StageSpec:
    return StageSpec(volume.id, Path(f"/staging/{volume.name}"), False, "", ())


def publish_of(volume: VolumeRecord, target: str) -> PublishSpec:
    return PublishSpec(volume.id, Path(f"/staging/{volume.name}"), Path(target), False, False, ())


async def test_a_restarted_qsd_gets_every_staged_volume_back_and_cut_off_calls_are_undone(tmp_path: Path) -> None:
    daemons, host = [FakeDaemon()], FakeHostState()
    async with fake_node(tmp_path, daemons=daemons, state=host) as f:
        kept, unstaging = await f.new_volume("kept"), await f.new_volume("unstaging")
        staging = await f.new_volume("staging")
        await f.node.stage(stage_of(kept))
        await f.node.publish(publish_of(kept, "/pod/kept"))
        await f.node.stage(stage_of(unstaging))
    cut_off: list[tuple[str, Callable[[FakeNode], Awaitable[None]]]] = [
        ("stage.after_intent", lambda f: f.node.stage(stage_of(staging))),
        ("unstage.after_intent", lambda f: f.node.unstage(unstaging.id, Path("/staging/unstaging"))),
        ("publish.after_intent", lambda f: f.node.publish(publish_of(kept, "/pod/half"))),
    ]
    for point, call in cut_off:  # each in a driver that crashes there
        async with fake_node(tmp_path, daemons=daemons, state=host, failpoints=CrashAt(point)) as f:
            with pytest.raises(Crash):
                await call(f)
    daemons[0].stop()
    daemons[0].restart()

    async with fake_node(tmp_path, daemons=daemons, state=host) as f:
        await f.rebuild()

        assert {s.volume_id: s.state for s in await f.catalog.stages()} == {kept.id: StageState.STAGED}
        assert [p.target_path for p in await f.catalog.publishes()] == [Path("/pod/kept")]
        assert [(c.volume_id, c.client) for c in f.kind.called("bring_up")] == [(kept.id, f.client())]
        assert [c.target for c in f.kind.called("publish")] == [Path("/pod/kept")]
        assert [c.target for c in f.kind.called("unpublish")] == [Path("/pod/half")]
        assert sorted((c.volume_id, c.thorough) for c in f.kind.called("tear_down")) == sorted(
            [(staging.id, True), (unstaging.id, True)])
        assert f.client().reads(kept.id) == graph.nodes_for(kept.id).format
        assert host.binds == {Path("/pod/kept"): kept.id}
        for gone in (staging, unstaging):
            assert host.of(gone.id) == [] and f.client().volume_nodes(gone.id) == set()


async def test_after_a_driver_restart_with_qsd_keeping_every_export_the_repair_runs_in_the_background(
    tmp_path: Path,
) -> None:
    daemons, host = [FakeDaemon()], FakeHostState()
    async with fake_node(tmp_path, daemons=daemons, state=host) as f:
        volume = await f.new_volume("a")
        await f.node.stage(stage_of(volume))
    stray = graph.nodes_for(STRAY)  # left by a volume whose unstage QSD never finished
    await daemons[0].client.blockdev_add(ImageFile(tmp_path / "gone.qcow2").protocol_blockdev(
        stray, VolumeParameters(), read_only=False))
    daemons[0].client.calls.clear()

    async with fake_node(tmp_path, daemons=daemons, state=host) as f:
        background = await f.node.rebuild(0)(daemons[0].client)
        assert background is not None and f.kind.calls == []  # calls are served meanwhile

        await background()

        assert [c.volume_id for c in f.kind.called("bring_up")] == [volume.id]
        assert "block-export-add" not in f.client().commands()
        assert f.client().volume_nodes(STRAY) == set() and f.client().volume_nodes(volume.id)


async def test_after_a_qsd_restart_the_repair_is_done_before_calls_are_served(tmp_path: Path) -> None:
    async with fake_node(tmp_path) as f:
        volume = await f.new_volume("a")
        await f.node.stage(stage_of(volume))
        f.daemons[0].restart()

        assert await f.node.rebuild(0)(f.client()) is None

        assert len(f.kind.called("bring_up")) == 2
        assert f.client().reads(volume.id) == graph.nodes_for(volume.id).format


async def test_a_shards_rebuild_touches_only_the_volumes_staged_on_it(tmp_path: Path) -> None:
    async with fake_node(tmp_path, shards=2) as f:
        on_0, on_1 = await f.new_volume("a", namespace="one"), await f.new_volume("b", namespace="two")
        for volume in (on_0, on_1):
            await f.node.stage(stage_of(volume))
        shards = {s.volume_id: s.shard for s in await f.catalog.stages()}
        assert sorted(shards.values()) == [0, 1], "the namespaces must land on both shards"
        restarted = shards[on_1.id]
        untouched = f.client(1 - restarted)
        before = dict(untouched.nodes)
        f.kind.calls.clear()
        f.daemons[restarted].restart()

        await f.rebuild(restarted)

        assert [(c.volume_id, c.client) for c in f.kind.called("bring_up")] == [(on_1.id, f.client(restarted))]
        assert untouched.nodes == before
        assert {volume_id: f.qsd.shard_of(volume_id) for volume_id in shards} == shards
