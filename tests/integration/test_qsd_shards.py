"""Several QSDs on one node (`--qsd-shards`): each serves its volumes, and a crash takes down only its own.

The driver runs in this event loop with two shards; volumes are placed by
their lineage (or the claim's namespace), so the test creates volumes until
each shard serves some. Everything is checked where an operator would look:
the QSD processes, each one's exports over its own QMP socket, the data
behind the mounts, and the CSI answers.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.errors import StartupError
from csi_qsd.metrics import Metrics
from csi_qsd.params import NAMESPACE_KEY
from csi_qsd.qsd import vhost_greeting
from csi_qsd.server import Driver, serving
from testing.harness import Sandbox, in_process_driver, qsd_pid, until, wait_restored, write_synced
from testing.helpers.shard_placement import namespace_on

MIB = 1 << 20


async def exports_of(driver: Driver, shard: int) -> set[str]:
    return {name for name in await driver.qsd.daemons[shard].client.exports()}


async def stage_until_both_shards(driver: Driver, csi: CSIClient, box: Sandbox) -> dict[int, list[str]]:
    """Create and stage volumes (each its own lineage) until each of the two shards serves two."""
    placed_on: dict[int, list[str]] = {0: [], 1: []}
    for i in range(24):
        vid = (await csi.create_volume(f"pvc-{i}", 64 * MIB)).volume_id
        await csi.stage(vid, str(box.staging(vid)))
        stage = await driver.catalog.stage(vid)
        assert stage is not None
        placed_on[stage.shard].append(vid)
        if all(len(v) >= 2 for v in placed_on.values()):
            return placed_on
    raise AssertionError(f"24 volumes never spread over both shards: {placed_on}")


async def unstage_when_free(csi: CSIClient, vid: str, path: Path) -> None:
    """NodeUnstageVolume as kubelet retries it: ABORTED while the adopted shard's check still holds the volume."""
    for _ in range(100):
        try:
            await csi.unstage(vid, str(path))
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.ABORTED:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError(f"volume {vid} stayed busy")


async def test_each_shard_serves_its_volumes_and_a_crash_stays_in_its_shard(box: Sandbox) -> None:
    async with in_process_driver(box, qsd_shards=2, qmp_timeout=2.0) as (driver, csi):
        pids = [qsd_pid(box, 0), qsd_pid(box, 1)]
        assert None not in pids and pids[0] != pids[1], "two shards, two QSD processes"
        placed_on = await stage_until_both_shards(driver, csi, box)
        for shard, volumes in placed_on.items():
            served = await exports_of(driver, shard)
            for vid in volumes:
                assert any(vid.removeprefix("vol-") in name for name in served), (vid, shard, served)
            other = placed_on[1 - shard]
            assert not any(vid.removeprefix("vol-") in name for vid in other for name in served)
        for volumes in placed_on.values():
            for vid in volumes:
                write_synced(box.staging(vid) / "data", vid.encode() * 1000)
        # A VM disk on each shard (a namespace that places it there), answering a vhost-user client.
        sockets = {}
        for shard in (0, 1):
            vid = (await csi.create_volume(f"vm-{shard}", 64 * MIB, {"export": "vhost-user-blk",
                                                                    NAMESPACE_KEY: namespace_on(shard, 2)})).volume_id
            await csi.stage(vid, str(box.staging(vid)))
            await csi.publish(vid, str(box.staging(vid)), str(box.target(vid)))
            assert (await driver.catalog.stage(vid) or pytest.fail("not staged")).shard == shard
            sockets[shard] = box.target(vid) / "vhost-user-blk.sock"
            assert await vhost_greeting.greet(sockets[shard])
            placed_on[shard].append(vid)

        os.kill(pids[1] or 0, signal.SIGKILL)
        # Shard 0's volumes keep serving while shard 1 is down and coming back.
        assert await vhost_greeting.greet(sockets[0])
        for vid in placed_on[0][:-1]:
            assert (box.staging(vid) / "data").read_bytes() == vid.encode() * 1000
        await until(lambda: qsd_pid(box, 1) not in (None, pids[1]), "shard 1 to be replaced", 30)
        for vid in placed_on[1][:-1]:
            await wait_restored(csi, vid, box.staging(vid))
            assert (box.staging(vid) / "data").read_bytes() == vid.encode() * 1000
        await wait_restored(csi, placed_on[1][-1], box.target(placed_on[1][-1]))
        assert await vhost_greeting.greet(sockets[1]), "the VM disk of the lost shard is served again"
        assert qsd_pid(box, 0) == pids[0], "shard 0 was not touched"
        assert driver.qsd.daemons[0].restarts == 0 and driver.qsd.daemons[1].restarts == 1
        scraped = (await Metrics(driver).render()).decode()
        assert 'csi_qsd_qsd_restarts_total{shard="0"} 0.0' in scraped
        assert 'csi_qsd_qsd_restarts_total{shard="1"} 1.0' in scraped
        assert 'csi_qsd_qsd_ready{shard="1"} 1.0' in scraped
        for vid in placed_on[0][:-1]:
            stats = await csi.stats(vid, str(box.staging(vid)))
            assert not stats.volume_condition.abnormal

        # The driver goes away and comes back: it adopts both shards, killing neither.
        new_pids = [qsd_pid(box, 0), qsd_pid(box, 1)]
        await driver.qsd.close()
        await driver.qsd.start(driver.node.rebuild)
        assert [qsd_pid(box, 0), qsd_pid(box, 1)] == new_pids
        for volumes in placed_on.values():
            for vid in volumes[:-1]:
                assert (box.staging(vid) / "data").read_bytes() == vid.encode() * 1000
                await unstage_when_free(csi, vid, box.staging(vid))
        for shard, socket in sockets.items():
            assert await vhost_greeting.greet(socket)
            vid = placed_on[shard][-1]
            await csi.unpublish(vid, str(box.target(vid)))
            await unstage_when_free(csi, vid, box.staging(vid))
        assert await exports_of(driver, 0) == set() and await exports_of(driver, 1) == set()


async def test_a_lineage_and_a_namespace_stay_in_one_shard(box: Sandbox) -> None:
    """A clone is served where its source is; a namespace's volumes share a shard, so a group is cut at once."""
    async with in_process_driver(box, qsd_shards=2) as (driver, csi):
        placed_on = await stage_until_both_shards(driver, csi, box)
        for shard, volumes in placed_on.items():
            clone = (await csi.create_volume(f"clone-{shard}", 64 * MIB, from_volume=volumes[0])).volume_id
            await csi.stage(clone, str(box.staging(clone)))
            stage = await driver.catalog.stage(clone)
            assert stage is not None and stage.shard == shard

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await csi.create_group_snapshot("across", [placed_on[0][0], placed_on[1][0]])
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "shards" in (refused.value.details() or "")

        members = []
        for i in range(4):
            vid = (await csi.create_volume(f"team-{i}", 64 * MIB, {NAMESPACE_KEY: "team-a"})).volume_id
            await csi.stage(vid, str(box.staging(vid)))
            members.append(vid)
        shards = {(await driver.catalog.stage(vid) or pytest.fail("not staged")).shard for vid in members}
        assert len(shards) == 1
        group = await csi.create_group_snapshot("team-a-group", members)
        assert len(group.snapshots) == 4 and all(s.ready_to_use for s in group.snapshots)


async def test_fewer_shards_than_stages_use_is_refused_at_start(box: Sandbox) -> None:
    """Lowering --qsd-shards under a staged volume would orphan its QSD: the start says what to do."""
    async with in_process_driver(box, qsd_shards=2) as (driver, csi):
        await stage_until_both_shards(driver, csi, box)
    with pytest.raises(StartupError, match="--qsd-shards 2 or more"):
        async with serving(box.config(qsd_shards=1)):
            pass
    # Once nothing is staged on shard 1, one shard is enough: the start stops the QSD nobody would supervise.
    async with in_process_driver(box, qsd_shards=2) as (driver, csi):
        for stage in await driver.catalog.stages():
            await unstage_when_free(csi, stage.volume_id, stage.staging_path)
    async with serving(box.config(qsd_shards=2)):
        pass  # a driver with two shards goes away, leaving both QSDs running
    left = qsd_pid(box, 1)
    assert left is not None
    async with serving(box.config(qsd_shards=1)) as driver:
        assert qsd_pid(box, 1) is None and qsd_pid(box, 0) is not None
        await driver.qsd.shutdown()
