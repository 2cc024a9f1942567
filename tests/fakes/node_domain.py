"""A node's domain assembled over the doubles, as `csi_qsd.server.running_driver` assembles the real one."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from csi_qsd.catalog import Catalog, VolumeRecord
from csi_qsd.controller.live import LiveImages
from csi_qsd.controller.snapshots import Snapshots
from csi_qsd.controller.volumes import Volumes
from csi_qsd.exports.base import ExportHost
from csi_qsd.node.rebuild import Backoff
from csi_qsd.node.staging import Staging
from csi_qsd.params import VolumeParameters
from csi_qsd.qsd.shards import QSDShards
from csi_qsd.server import placed
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints
from csi_qsd.sys.locks import KeyedLocks
from tests.fakes.daemons import FakeDaemon, FakeQSDClient, fake_shards
from tests.fakes.exports import FakeExport, FakeExportPaths, FakeHostState
from tests.fakes.pools import FakeMovingPool, FakePool

MIB = 1 << 20


@dataclasses.dataclass
class FakeNode:
    """One node's domain over the doubles: the driver's own orchestrators, catalog and locks."""

    catalog: Catalog
    pool: FakePool
    moving_pool: FakeMovingPool
    qsd: QSDShards
    daemons: list[FakeDaemon]
    kind: FakeExport
    volumes: Volumes
    node: Staging
    snapshots: Snapshots

    def client(self, shard: int = 0) -> FakeQSDClient:
        return self.daemons[shard].client

    async def new_volume(self, name: str = "pvc-1", size: int = 64 * MIB, **params: Any) -> VolumeRecord:
        """A ready volume, created as CreateVolume creates it, with StorageClass `params`."""
        return await self.volumes.create(name, size, 0, VolumeParameters(**params), [])

    async def rebuild(self, shard: int = 0) -> None:
        """What the supervisor runs after (re)connecting to a shard's QSD: the rebuild, then serving calls
        while the background repair (if the rebuild left one) runs."""
        background = await self.node.rebuild(shard)(self.client(shard))
        self.daemons[shard].ready = True
        if background is not None:
            await background()


@contextlib.asynccontextmanager
async def fake_node(
    root: Path, *, shards: int = 1, daemons: list[FakeDaemon] | None = None, state: FakeHostState | None = None,
    failpoints: Failpoints = NO_FAILPOINTS, commits_before_switch: bool = False,
    before_open: Callable[[VolumeRecord], Awaitable[None]] | None = None, retry: Backoff = Backoff(),
) -> AsyncIterator[FakeNode]:
    """A node under `root`, assembled as `csi_qsd.server.running_driver` does; the same `root`, `daemons`
    and `state` again are the same node after a driver restart (QSD and the host kept what they had).
    `before_open` stands for the check of copy sources (`CopyLinkCheck`), `retry` paces stalled volumes' retries."""
    daemons = daemons if daemons is not None else [FakeDaemon() for _ in range(shards)]
    async with Catalog(root / "catalog.db") as catalog:
        pool = FakePool(root / "pool")
        moving_pool = FakeMovingPool(root / "fast", catalog)
        for each in (pool, moving_pool):
            each.prepare()
        await moving_pool.load()
        locks = KeyedLocks("volume")
        volumes = Volumes(catalog, pool, locks, failpoints, pools={moving_pool.id: moving_pool})
        await volumes.reconcile()
        qsd = fake_shards(root / "state", daemons)
        await placed(catalog, qsd)
        host = ExportHost(qsd, root / "exports", volumes.pools, failpoints, before_open=before_open)
        kind = FakeExport(host, state, commits_before_switch=commits_before_switch)
        exports = FakeExportPaths(host, kind)
        snapshots = Snapshots(catalog, pool, volumes, LiveImages(catalog, exports), locks, failpoints)
        node = Staging(catalog, pool, exports, locks, failpoints, on_unstaged=snapshots.flatten_later,
                           retry=retry)
        await snapshots.reconcile()
        try:
            yield FakeNode(catalog, pool, moving_pool, qsd, daemons, kind, volumes, node, snapshots)
        finally:
            await node.close()
            await snapshots.close()
            await volumes.close()  # background deletes end before the catalog closes, as in the driver
