"""`--qsd-mode external`: QSD runs in its own container (`csi-qsd qsd-run`) and the plugin adopts it.

This is the Kubernetes layout: restarting or upgrading the plugin container
must not stop QSD, and a restarted QSD container must get its graph back
from the plugin.
"""

from __future__ import annotations

import asyncio
import os
import signal

from csi_qsd.catalog import Catalog
from csi_qsd.cli.client import CSIClient
from testing.harness import DriverProcess, Sandbox, qsd_pid, until, wait_restored, write_synced
from testing.helpers.cli_process import start_qsd_container

MIB = 1 << 20


async def test_plugin_adopts_and_rebuilds_an_external_qsd(box: Sandbox) -> None:
    qsd = await start_qsd_container(box)
    driver = DriverProcess(box, "--qsd-mode", "external")
    try:
        await driver.start()
        pid = qsd_pid(box)
        assert pid == qsd.pid, "the plugin must use the QSD of the qsd container, not start its own"
        async with CSIClient(box.endpoint, timeout=60) as csi:
            vid = (await csi.create_volume("pvc-ext", 64 * MIB)).volume_id
            staging, target = box.staging("ext"), box.target("ext")
            await csi.stage(vid, str(staging))
            await csi.publish(vid, str(staging), str(target))
            (target / "a").write_bytes(b"before the plugin restart")
            os.sync()

            # Upgrading the plugin container: QSD and the mount are untouched.
            await driver.kill9()
            assert (target / "a").read_bytes() == b"before the plugin restart"
            await driver.start()
            assert qsd_pid(box) == qsd.pid
            await csi.publish(vid, str(staging), str(target))  # kubelet's retry is fine

            # The qsd container restarts: the plugin notices and rebuilds the graph.
            qsd.send_signal(signal.SIGKILL)
            await qsd.wait()
            qsd = await start_qsd_container(box)
            await wait_restored(csi, vid, target)
            assert (target / "a").read_bytes() == b"before the plugin restart"
            (target / "b").write_bytes(b"after the qsd restart")
            os.sync()
            await csi.unpublish(vid, str(target))
            await csi.unstage(vid, str(staging))
            await csi.delete_volume(vid)
    finally:
        await driver.stop()
        if qsd.returncode is None:
            qsd.send_signal(signal.SIGTERM)
            await qsd.wait()


async def test_qsd_run_keeps_every_shard_and_brings_back_one_that_dies(box: Sandbox) -> None:
    """`qsd-run --qsd-shards 2` keeps two QSDs; one that dies comes back and the plugin rebuilds its volumes."""
    keeper = await start_qsd_container(box, "--qsd-shards", "2")
    driver = DriverProcess(box, "--qsd-mode", "external", "--qsd-shards", "2")
    try:
        await until(lambda: qsd_pid(box, 0) is not None and qsd_pid(box, 1) is not None, "both shards up", 30)
        await driver.start()
        pids = [qsd_pid(box, 0), qsd_pid(box, 1)]
        async with CSIClient(box.endpoint, timeout=60) as csi:
            on_shard: dict[int, str] = {}
            staged: list[str] = []
            for i in range(24):
                vid = (await csi.create_volume(f"pvc-{i}", 64 * MIB)).volume_id
                await csi.stage(vid, str(box.staging(vid)))
                staged.append(vid)
                on_shard.setdefault(await shard_serving(box, vid), vid)
                if len(on_shard) == 2:
                    break
            assert len(on_shard) == 2, "volumes never spread over both shards"
            for vid in on_shard.values():
                write_synced(box.staging(vid) / "a", vid.encode())
            os.kill(pids[1] or 0, signal.SIGKILL)
            await until(lambda: qsd_pid(box, 1) not in (None, pids[1]), "qsd-run to start shard 1 again", 30)
            await wait_restored(csi, on_shard[1], box.staging(on_shard[1]))
            assert qsd_pid(box, 0) == pids[0]
            for vid in on_shard.values():
                assert (box.staging(vid) / "a").read_bytes() == vid.encode()
            for vid in staged:
                await csi.unstage(vid, str(box.staging(vid)))
        await driver.stop()
        keeper.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(keeper.wait(), 30) == 0
        assert qsd_pid(box, 0) is None and qsd_pid(box, 1) is None, "qsd-run stops its QSDs on the way out"
    finally:
        await driver.stop()
        if keeper.returncode is None:
            keeper.send_signal(signal.SIGKILL)
            await keeper.wait()


async def shard_serving(box: Sandbox, volume_id: str) -> int:
    """The shard a staged volume's row names, read from the catalog as an operator would."""
    async with Catalog(box.state_dir / "catalog.db") as catalog:
        stage = await catalog.stage(volume_id)
    assert stage is not None
    return stage.shard
