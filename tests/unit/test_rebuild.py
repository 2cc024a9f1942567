"""The graph rebuild (`GraphRebuild`) over doubles: what a crash left is finished or undone from the catalog.

Each driver "restart" is a new `fake_node` over the same catalog file, QSD
daemons and host state; a QSD restart is a fake QSD with an empty graph.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from csi_qsd.catalog import StageState, VolumeRecord
from csi_qsd.errors import SourceUnreachable, Unavailable
from csi_qsd.node.cut_off import REBUILT, CutOff
from csi_qsd.node.rebuild import Backoff
from csi_qsd.node.staging import PublishSpec, StageSpec
from csi_qsd.params import VolumeParameters
from csi_qsd.qsd import graph
from csi_qsd.qsd.storage import ImageFile
from testing.harness import until
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


# Volumes whose copy source is down when QSD restarts: stalled, reported, retried ----------------------------

SOURCE = "127.0.0.1:10809"


class Source:
    """Stands for `CopyLinkCheck`: the copy source of the volumes in `copies` greets only while `up`."""

    def __init__(self, copies: set[str]) -> None:
        self.copies = copies
        self.up = True
        self.asked = 0

    async def __call__(self, volume: VolumeRecord) -> None:
        if volume.id not in self.copies:
            return
        self.asked += 1
        if not self.up:
            raise SourceUnreachable(f"volume {volume.id}: node node-a does not answer at {SOURCE}",
                                    node="node-a", address=SOURCE)


FAST = Backoff(first=0.01, factor=2.0, cap=0.05)


def test_the_retry_back_off_grows_from_its_first_delay_to_its_cap_and_stays_there() -> None:
    backoff = Backoff()
    delays = [backoff.delay(attempt) for attempt in range(1000)]
    assert delays[0] == 2.0 and delays == sorted(delays)
    assert all(2.0 <= d <= 5.0 for d in delays) and delays[-1] == 5.0
    assert FAST.delay(0) == 0.01 and FAST.delay(10**6) == 0.05  # no overflow however long a source stays down


def _retries() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("rebuild-retry-") and not t.done()}


def _without_count(message: str) -> str:
    return re.sub(r"retried \d+ times", "retried N times", message)


async def test_a_volume_whose_copy_source_is_down_at_a_qsd_restart_is_retried_until_it_is_served(
    tmp_path: Path,
) -> None:
    daemons, host = [FakeDaemon()], FakeHostState()
    async with fake_node(tmp_path, daemons=daemons, state=host) as f:
        copy, other = await f.new_volume("copy"), await f.new_volume("other")
        for volume in (copy, other):
            await f.node.stage(stage_of(volume))
            await f.node.publish(publish_of(volume, f"/pod/{volume.name}"))
    source = Source({copy.id})
    daemons[0].stop()
    daemons[0].restart()
    source.up = False

    async with fake_node(tmp_path, daemons=daemons, state=host, before_open=source, retry=FAST) as f:
        await f.rebuild()

        # The other volume is back; the copy is staged but not served, says why, and is being retried.
        assert f.client().reads(other.id) == graph.nodes_for(other.id).format
        assert host.binds.get(Path("/pod/other")) == other.id
        assert f.client().volume_nodes(copy.id) == set()
        assert {s.volume_id for s in await f.catalog.stages()} == {copy.id, other.id}
        message = f.node.stalled(copy.id)
        assert message is not None and "node node-a" in message and SOURCE in message and "retries" in message
        assert f.node.stalled(other.id) is None
        stats = await f.node.stats(copy.id, Path("/pod/copy"))
        # The same words; only the count of retries so far may have moved on (one every 10-50 ms here).
        assert stats.abnormal and _without_count(stats.message) == _without_count(message)
        with pytest.raises(Unavailable, match="node node-a"):
            await f.node.publish(publish_of(copy, "/pod/second"))
        asked = source.asked
        await until(lambda: source.asked >= asked + 3, "the source asked again, with back-off", 30, interval=0.01)
        assert f.client().volume_nodes(copy.id) == set()

        source.up = True
        await until(lambda: f.node.stalled(copy.id) is None, "the stalled volume served again", 30, interval=0.01)
        assert f.client().reads(copy.id) == graph.nodes_for(copy.id).format
        assert host.binds.get(Path("/pod/copy")) == copy.id
        assert (await f.catalog.stage(copy.id)) is not None
        await until(lambda: not _retries(), "the retry task ended", 30, interval=0.01)
        asked = source.asked
        await asyncio.sleep(0.2)  # long past the back-off's cap: nothing more is asked once served
        assert source.asked == asked


async def test_a_stalled_volume_is_no_longer_retried_once_unstaged_nor_after_shutdown(tmp_path: Path) -> None:
    daemons, host = [FakeDaemon()], FakeHostState()
    async with fake_node(tmp_path, daemons=daemons, state=host) as f:
        gone, kept = await f.new_volume("gone"), await f.new_volume("kept")
        for volume in (gone, kept):
            await f.node.stage(stage_of(volume))
    source = Source({gone.id, kept.id})
    daemons[0].restart()
    source.up = False

    async with fake_node(tmp_path, daemons=daemons, state=host, before_open=source, retry=FAST) as f:
        await f.rebuild()
        assert f.node.stalled(gone.id) and f.node.stalled(kept.id)
        assert len(_retries()) == 2

        await f.node.unstage(gone.id, Path("/staging/gone"))

        assert f.node.stalled(gone.id) is None and await f.catalog.stage(gone.id) is None
        await until(lambda: len(_retries()) == 1, "the unstaged volume's retry ended", 5, interval=0.01)
    # Driver shutdown: the remaining retry is cancelled, not left running; the volume stays staged for the next driver.
    assert not _retries()
    async with fake_node(tmp_path, daemons=daemons, state=host) as f:
        assert (await f.catalog.stage(kept.id)) is not None


async def test_a_target_published_before_a_lost_export_reports_the_rebuild_until_unpublished(tmp_path: Path) -> None:
    host = FakeHostState()
    async with fake_node(tmp_path, state=host) as f:
        lost, kept = await f.new_volume("lost"), await f.new_volume("kept")
        for volume in (lost, kept):
            await f.node.stage(stage_of(volume))
            await f.node.publish(publish_of(volume, f"/pod/{volume.name}"))
        heard: list[CutOff] = []
        f.node.cut_off.listen(heard.append)
        host.broken.add(lost.id)  # its FUSE file answers ENOTCONN: QSD died under it
        f.daemons[0].restart()
        await f.rebuild()

        assert [(c.volume_id, c.targets) for c in heard] == [(lost.id, (Path("/pod/lost"),))]
        at_target = await f.node.stats(lost.id, Path("/pod/lost"))
        assert at_target.abnormal and REBUILT in at_target.message and lost.id in at_target.message
        assert not (await f.node.stats(lost.id, Path("/staging/lost"))).abnormal
        assert not (await f.node.stats(kept.id, Path("/pod/kept"))).abnormal  # its export survived

        await f.node.unpublish(lost.id, Path("/pod/lost"))
        await f.node.publish(publish_of(lost, "/pod/lost"))  # a new pod, on the new data path
        assert not (await f.node.stats(lost.id, Path("/pod/lost"))).abnormal
