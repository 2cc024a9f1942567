"""VM clients connecting and leaving while other volumes come and go: QSD must live through it.

On QSD 10.0.13 a vhost-user-blk export in an iothread aborted QSD
(vhost_user_server_attach_aio_context: "Assertion `!co_ctx || co_ctx == ctx'
failed") when a client connected or left while a graph change (any
blockdev-add or blockdev-del, which drains every node) was under way: within
the first 1 to 43 connections. There the driver runs these exports in QSD's
main loop. QEMU 11.1.3 no longer aborts with the exports in iothreads, but
fails later graph changes with EBADF in some runs (see csi_qsd.qsd.features), so
the driver keeps them in the main loop there too: the test runs on the
default QSD and on the 11 runtime the install provides beside it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.qsd import features
from csi_qsd.server import Driver, serving
from csi_qsd.sys.tools import bundled
from testing.harness import Sandbox, in_process_driver, qsd_pid
from testing.helpers.vhost_clients import CONNECTIONS, VM, come_and_go, graph_round

MIB = 1 << 20
ROUNDS_MIN = 10
TIME_LIMIT = 240.0


@pytest.fixture(params=["default", "11"])
async def churn_driver(request: pytest.FixtureRequest, box: Sandbox) -> AsyncIterator[tuple[Driver, CSIClient]]:
    overrides: dict[str, object] = {}
    if request.param == "11":
        overrides["qsd_binary"] = bundled("qemu-storage-daemon-11")
    async with in_process_driver(box, **overrides) as pair:
        if request.param == "11":
            assert pair[0].daemon.version >= (11, 1, 3), "the install provides QEMU 11.1.3"
        assert (pair[0].daemon.vhost_iothreads() is not None) is features.vhost_export_in_iothread(
            pair[0].daemon.version)
        yield pair


async def test_vm_clients_come_and_go_while_other_volumes_change(
    box: Sandbox, churn_driver: tuple[Driver, CSIClient],
) -> None:
    daemon, csi = churn_driver
    pid, restarts = qsd_pid(box), daemon.daemon.restarts
    vid = (await csi.create_volume("pvc-vm-churn", 32 * MIB, VM)).volume_id
    staging, target = box.staging("vm-churn"), box.target("vm-churn")
    await csi.stage(vid, str(staging))
    await csi.publish(vid, str(staging), str(target))
    stop, count = asyncio.Event(), [0]
    clients = asyncio.create_task(come_and_go(str(target / "vhost-user-blk.sock"), stop, count))
    deadline = asyncio.get_running_loop().time() + TIME_LIMIT
    i = 0
    try:
        # Each stage, snapshot and unstage adds or removes block nodes: graph changes.
        while i < ROUNDS_MIN or (count[0] < CONNECTIONS and asyncio.get_running_loop().time() < deadline):
            await graph_round(csi, box, i)
            i += 1
    finally:
        stop.set()
        await clients
    print(f"connections={count[0]} graph_rounds={i} restarts={daemon.daemon.restarts - restarts}")
    assert count[0] >= CONNECTIONS, "the clients must have come and gone throughout"
    assert (qsd_pid(box), daemon.daemon.restarts) == (pid, restarts), "QSD died under the VM clients"
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))


async def test_an_adopted_qsd_gets_the_pool_it_lacks(box: Sandbox) -> None:
    """A QSD started with fewer iothreads (an older driver made one) is given the rest live, with their budget."""
    async with serving(box.config(iothreads=1)) as first:
        assert await first.daemon.client.iothreads() >= {"iothread0"}
        pid = qsd_pid(box)
    async with serving(box.config(iothreads=2, poll_max_ns=0)) as second:
        assert qsd_pid(box) == pid, "the second driver adopts the running QSD"
        assert await second.daemon.client.iothreads() >= {"iothread0", "iothread1"}
        for thread in ("iothread0", "iothread1"):
            budget = await second.daemon.client.execute(
                "qom-get", {"path": f"/objects/{thread}", "property": "poll-max-ns"})
            assert budget == 0, f"{thread} kept its polling budget"
        await second.daemon.shutdown()
