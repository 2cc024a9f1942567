"""The staging orchestrator (`Staging`) over doubles: intent rows, undo, idempotency, codes, shards.

The export kind, QSD and the pool are `tests.fakes`; the catalog is a real
one in tmp_path. What the host and QSD do for real is the integration
tier's (`tests/integration/test_lifecycle.py`, `test_crash.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd.catalog import StageState, VolumeRecord
from csi_qsd.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    HostCommandError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from csi_qsd.node.staging import PublishSpec, StageSpec
from csi_qsd.qsd import graph
from testing.helpers.shard_placement import namespace_on
from tests.fakes import FakeNode, fake_node


@pytest.fixture
async def f(tmp_path: Path) -> AsyncIterator[FakeNode]:
    async with fake_node(tmp_path) as node:
        yield node


def staged_at(volume: VolumeRecord, *, path: str = "/staging/a", block: bool = False, fs_type: str = "",
              ) -> StageSpec:
    return StageSpec(volume.id, Path(path), block, fs_type, ())


def published_at(volume: VolumeRecord, target: str, *, readonly: bool = False, single_writer: bool = False,
                 ) -> PublishSpec:
    return PublishSpec(volume.id, Path("/staging/a"), Path(target), False, readonly, (), single_writer=single_writer)


# stage -----------------------------------------------------------------


async def test_stage_records_its_intent_before_the_kind_works_and_commits_what_it_returns(f: FakeNode) -> None:
    volume = await f.new_volume()
    seen = []

    async def look() -> None:
        seen.append(await f.catalog.stage(volume.id))

    f.kind.at("bring_up", look)
    await f.node.stage(staged_at(volume))

    assert seen[0] is not None and seen[0].state is StageState.STAGING and not seen[0].loop_device
    row = await f.catalog.stage(volume.id)
    assert row is not None and row.state is StageState.STAGED and row.fs_type == "ext4"
    assert f.kind.state.loops == {row.loop_device: volume.id}
    assert f.client().reads(volume.id) == graph.nodes_for(volume.id).format


@pytest.mark.parametrize("step", ["export", "loop", "mount"])
async def test_a_kind_failing_mid_bring_up_leaves_no_stage_row_and_nothing_behind(f: FakeNode, step: str) -> None:
    volume = await f.new_volume()
    f.kind.fail_at(step, HostCommandError("mkfs.ext4 failed with exit status 1"))

    with pytest.raises(HostCommandError, match="mkfs"):
        await f.node.stage(staged_at(volume))

    assert await f.catalog.stage(volume.id) is None
    assert [call.thorough for call in f.kind.called("tear_down")] == [True]
    assert f.kind.state.of(volume.id) == [] and f.client().volume_nodes(volume.id) == set()
    await f.node.stage(staged_at(volume))  # the CO's retry
    assert (row := await f.catalog.stage(volume.id)) is not None and row.state is StageState.STAGED


async def test_a_retried_stage_is_a_retry(f: FakeNode) -> None:
    volume = await f.new_volume()
    await f.node.stage(staged_at(volume))
    first = await f.catalog.stage(volume.id)

    await f.node.stage(staged_at(volume))

    assert await f.catalog.stage(volume.id) == first
    assert len(f.kind.called("bring_up")) == 2 and not f.kind.called("tear_down")
    assert list(f.kind.state.loops.values()) == [volume.id]


async def test_a_retried_stage_brings_back_a_lost_export_and_records_its_new_loop_device(f: FakeNode) -> None:
    volume = await f.new_volume()
    await f.node.stage(staged_at(volume))
    first = await f.catalog.stage(volume.id)
    assert first is not None
    f.client().new_process()  # QSD lost the export (and the loop device on it is dead)

    await f.node.stage(staged_at(volume))

    row = await f.catalog.stage(volume.id)
    assert row is not None and row.loop_device != first.loop_device
    assert f.kind.state.loops == {row.loop_device: volume.id}
    assert f.client().reads(volume.id) == graph.nodes_for(volume.id).format


@pytest.mark.parametrize("other, error, words", [
    (dict(path="/staging/b"), FailedPrecondition, "already staged at /staging/a"),
    (dict(block=True), AlreadyExists, "staged as mount/ext4"),
    (dict(fs_type="xfs"), AlreadyExists, "staged as mount/ext4"),
])
async def test_a_stage_with_other_arguments_is_refused(
    f: FakeNode, other: dict[str, object], error: type[Exception], words: str,
) -> None:
    volume = await f.new_volume()
    await f.node.stage(staged_at(volume))
    before = await f.catalog.stage(volume.id)

    with pytest.raises(error, match=f"volume {volume.id} .*{words}"):
        await f.node.stage(staged_at(volume, **other))  # type: ignore[arg-type]

    assert await f.catalog.stage(volume.id) == before
    assert len(f.kind.called("bring_up")) == 1 and not f.kind.called("tear_down")


async def test_a_stage_of_a_missing_volume_is_not_found(f: FakeNode) -> None:
    with pytest.raises(NotFound, match="vol-000000000000000000000001"):
        await f.node.stage(StageSpec("vol-000000000000000000000001", Path("/staging/a"), False, "", ()))
    assert f.kind.calls == []


async def test_a_second_call_on_a_volume_while_one_runs_is_aborted(f: FakeNode) -> None:
    volume = await f.new_volume()
    refused: list[Exception] = []

    async def meanwhile() -> None:
        for call in (f.node.stage(staged_at(volume)), f.node.unstage(volume.id, Path("/staging/a"))):
            try:
                await call
            except Aborted as exc:
                refused.append(exc)

    f.kind.at("loop", meanwhile)
    await f.node.stage(staged_at(volume))

    assert len(refused) == 2 and all(volume.id in str(exc) for exc in refused)
    assert len(f.kind.called("bring_up")) == 1


# QSD away -----------------------------------------------------------------


async def test_a_qsd_not_ready_gives_unavailable_and_changes_nothing(f: FakeNode) -> None:
    volume, other = await f.new_volume(), await f.new_volume("pvc-2")
    await f.node.stage(staged_at(other, path="/staging/o"))
    staged = await f.catalog.stage(other.id)
    f.kind.calls.clear()
    f.daemons[0].ready = False  # starting or rebuilding

    with pytest.raises(Unavailable, match="not ready"):
        await f.node.stage(staged_at(volume))
    with pytest.raises(Unavailable, match="not ready"):
        await f.node.unstage(other.id, Path("/staging/o"))
    with pytest.raises(Unavailable, match="not ready"):
        await f.node.publish(PublishSpec(other.id, Path("/staging/o"), Path("/pod/t"), False, False, ()))

    assert await f.catalog.stage(volume.id) is None and await f.catalog.stage(other.id) == staged
    assert await f.catalog.publishes() == [] and f.kind.calls == []
    stats = await f.node.stats(other.id, Path("/staging/o"))
    assert stats.abnormal and stats.total_bytes == other.capacity


async def test_a_step_cut_off_by_a_dying_qsd_is_unavailable_and_the_rebuild_undoes_it(f: FakeNode) -> None:
    volume = await f.new_volume()

    async def qsd_dies() -> None:
        f.daemons[0].stop()
        raise HostCommandError("losetup: /exports/disk: failed to set up loop device: Transport endpoint")

    f.kind.at("loop", qsd_dies)
    with pytest.raises(Unavailable, match="went away"):
        await f.node.stage(staged_at(volume))
    # The undo could not reach QSD: the intent stays for the rebuild after the restart.
    assert (row := await f.catalog.stage(volume.id)) is not None and row.state is StageState.STAGING

    f.daemons[0].restart()
    await f.rebuild()

    assert await f.catalog.stage(volume.id) is None
    assert f.kind.state.of(volume.id) == [] and f.client().volume_nodes(volume.id) == set()


@pytest.mark.parametrize("broken, error", [(True, Unavailable), (False, OSError)])
async def test_a_host_call_failing_on_a_broken_export_is_unavailable(
    f: FakeNode, broken: bool, error: type[Exception],
) -> None:
    volume = await f.new_volume()
    await f.node.stage(staged_at(volume))
    await f.node.publish(published_at(volume, "/pod/t"))
    if broken:
        f.kind.state.broken.add(volume.id)  # its FUSE file answers ENOTCONN: the QSD behind it is gone
    f.kind.fail_at("unpublish", OSError(107, "Transport endpoint is not connected"))

    with pytest.raises(error, match="Transport endpoint"):
        await f.node.unpublish(volume.id, Path("/pod/t"))


# unstage -----------------------------------------------------------------


async def test_unstage_while_published_is_failed_precondition(f: FakeNode) -> None:
    volume = await f.new_volume()
    await f.node.stage(staged_at(volume))
    await f.node.publish(published_at(volume, "/pod/t"))

    with pytest.raises(FailedPrecondition, match=f"volume {volume.id} is still published at /pod/t"):
        await f.node.unstage(volume.id, Path("/staging/a"))
    assert (row := await f.catalog.stage(volume.id)) is not None and row.state is StageState.STAGED
    assert not f.kind.called("tear_down")

    await f.node.unpublish(volume.id, Path("/pod/t"))
    await f.node.unstage(volume.id, Path("/staging/a"))
    assert await f.catalog.stage(volume.id) is None and await f.catalog.publishes() == []
    assert f.kind.state.of(volume.id) == [] and f.client().volume_nodes(volume.id) == set()


async def test_unstage_and_unpublish_of_what_is_not_there_succeed(f: FakeNode) -> None:
    volume = await f.new_volume()
    await f.node.unstage(volume.id, Path("/staging/a"))
    await f.node.unpublish(volume.id, Path("/pod/t"))
    await f.node.stage(staged_at(volume))
    await f.node.unstage(volume.id, Path("/staging/elsewhere"))

    assert (row := await f.catalog.stage(volume.id)) is not None and row.state is StageState.STAGED
    assert not f.kind.called("tear_down") and not f.kind.called("unpublish")
    with pytest.raises(NotFound, match="vol-000000000000000000000001"):
        await f.node.unstage("vol-000000000000000000000001", Path("/staging/a"))


# publish -----------------------------------------------------------------


async def test_publish_needs_the_volume_staged_there_and_the_same_way(f: FakeNode) -> None:
    volume = await f.new_volume()
    with pytest.raises(FailedPrecondition, match=f"volume {volume.id} is not staged at /staging/a"):
        await f.node.publish(published_at(volume, "/pod/t"))
    await f.node.stage(staged_at(volume))
    with pytest.raises(InvalidArgument, match=f"volume {volume.id} is staged as mount"):
        await f.node.publish(PublishSpec(volume.id, Path("/staging/a"), Path("/pod/t"), True, False, ()))
    assert await f.catalog.publishes() == [] and not f.kind.called("publish")


async def test_a_retried_publish_is_a_retry_and_other_arguments_are_already_exists(f: FakeNode) -> None:
    volume, other = await f.new_volume(), await f.new_volume("pvc-2")
    await f.node.stage(staged_at(volume))
    await f.node.stage(staged_at(other, path="/staging/o"))
    await f.node.publish(published_at(volume, "/pod/t"))
    rows = await f.catalog.publishes()

    await f.node.publish(published_at(volume, "/pod/t"))
    with pytest.raises(AlreadyExists, match=f"volume {volume.id} is already published at /pod/t"):
        await f.node.publish(published_at(volume, "/pod/t", readonly=True))
    with pytest.raises(AlreadyExists, match=f"target /pod/t already holds volume {volume.id}"):
        await f.node.publish(PublishSpec(other.id, Path("/staging/o"), Path("/pod/t"), False, False, ()))

    assert await f.catalog.publishes() == rows and f.kind.state.binds == {Path("/pod/t"): volume.id}


@pytest.mark.parametrize("first, second", [(True, False), (False, True), (True, True)])
async def test_a_single_writer_holds_the_volume_alone(f: FakeNode, first: bool, second: bool) -> None:
    volume = await f.new_volume()
    await f.node.stage(staged_at(volume))
    await f.node.publish(published_at(volume, "/pod/one", single_writer=first))

    with pytest.raises(FailedPrecondition, match=f"volume {volume.id} is already published at /pod/one"):
        await f.node.publish(published_at(volume, "/pod/two", single_writer=second))

    assert [p.target_path for p in await f.catalog.publishes()] == [Path("/pod/one")]
    assert f.kind.state.binds == {Path("/pod/one"): volume.id}


async def test_writers_that_are_not_single_share_the_volume(f: FakeNode) -> None:
    volume = await f.new_volume()
    await f.node.stage(staged_at(volume))
    await f.node.publish(published_at(volume, "/pod/one"))
    await f.node.publish(published_at(volume, "/pod/two"))
    assert sorted(p.target_path for p in await f.catalog.publishes()) == [Path("/pod/one"), Path("/pod/two")]


async def test_a_failed_publish_leaves_no_publish_row_and_no_bind(f: FakeNode) -> None:
    volume = await f.new_volume()
    await f.node.stage(staged_at(volume))
    f.kind.fail_at("publish", HostCommandError("mount --bind failed"))

    with pytest.raises(HostCommandError):
        await f.node.publish(published_at(volume, "/pod/t"))

    assert await f.catalog.publishes() == [] and f.kind.state.binds == {}
    assert [call.target for call in f.kind.called("unpublish")] == [Path("/pod/t")]


# shards -----------------------------------------------------------------


async def test_the_shard_in_the_stage_row_is_the_one_that_serves_the_volume(tmp_path: Path) -> None:
    async with fake_node(tmp_path, shards=2) as f:
        volume = await f.new_volume(namespace=namespace_on(1, 2))
        await f.node.stage(staged_at(volume))
        row = await f.catalog.stage(volume.id)
        assert row is not None and row.shard == 1
        assert [call.client for call in f.kind.called("bring_up")] == [f.client(1)]
        assert f.client(1).volume_nodes(volume.id) and f.client(0).calls == []

        # A row naming shard 0 (another placement once): shard 0 serves it, whatever placement says now.
        await f.catalog.put_stage(dataclasses.replace(row, shard=0))
        f.daemons[1].ready = False
        await f.node.stage(staged_at(volume))  # a retry: brought up where the row says
        assert f.kind.called("bring_up")[-1].client is f.client(0)

        f.daemons[1].ready, f.daemons[0].ready = True, False
        with pytest.raises(Unavailable):
            await f.node.publish(published_at(volume, "/pod/t"))
        assert (await f.node.stats(volume.id, Path("/staging/a"))).abnormal
        f.daemons[0].ready = True
        await f.node.unstage(volume.id, Path("/staging/a"))
        assert f.kind.called("tear_down")[-1].client is f.client(0)
        assert f.client(0).volume_nodes(volume.id) == set()
