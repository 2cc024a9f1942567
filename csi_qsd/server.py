"""Assemble one driver: catalog → reconcile → QSD supervisor → gRPC server.

Startup and teardown nest in that order, so nothing serves before the catalog
is consistent and the daemon's graph rebuilt, and nothing outlives what it
uses. Stopping the driver leaves QSD and every export running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc

from csi_qsd.catalog import Catalog, CopyRole
from csi_qsd.config import Config
from csi_qsd.controller.changed_blocks import ChangedBlocks
from csi_qsd.controller.copy_sources import CopySources
from csi_qsd.controller.copy_targets import CopyLinkCheck, CopyTargets
from csi_qsd.controller.health import HealthView
from csi_qsd.controller.key_rotation import KeyRotation
from csi_qsd.controller.live import LiveImages
from csi_qsd.controller.snapshots import Snapshots
from csi_qsd.controller.volume_limits import VolumeLimits
from csi_qsd.controller.volumes import Volumes
from csi_qsd.copy_terms import CopySettings
from csi_qsd.csi.controller import ControllerService, CopyEnds
from csi_qsd.csi.copy_service import copy_handler, copy_leases_handler
from csi_qsd.csi.errors import RpcObservers
from csi_qsd.csi.group_controller import GroupControllerService
from csi_qsd.csi.heal_pods import PodHealer
from csi_qsd.csi.identity import IdentityService
from csi_qsd.csi.metadata_listener import serving_metadata_listener
from csi_qsd.csi.node import NodeService
from csi_qsd.csi.snapshot_contents import ContentClaimer
from csi_qsd.csi.snapshot_metadata import SnapshotMetadataService
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import StartupError
from csi_qsd.exports.base import ExportHost
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.node.copy_fill import CopyFill
from csi_qsd.node.staging import Staging
from csi_qsd.pools.base import Pool
from csi_qsd.pools.device_pools import open_device_pools
from csi_qsd.pools.files import FilePool
from csi_qsd.pools.managed import pool_directory
from csi_qsd.qsd import features
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.daemon import Rebuild
from csi_qsd.qsd.shards import QSDShards
from csi_qsd.sys import mounts, runtime, volume_keys
from csi_qsd.sys.failpoints import Failpoints
from csi_qsd.sys.locks import KeyedLocks
from csi_qsd.sys.tools import bundled
from csi_qsd.sys.volume_keys import KeyStore
from csi_qsd.transport import unix_socket
from csi_qsd.transport.copy_peer_pods import PodCopyPeers
from csi_qsd.transport.copy_peers import CopyPeerList, CopyPeerNodes, StaticCopyPeers
from csi_qsd.transport.kube_api import InCluster

log = logging.getLogger(__name__)


class Driver:
    """A running driver's parts, for the server and for tests that look inside."""

    def __init__(
        self, config: Config, catalog: Catalog, qsd: QSDShards, volumes: Volumes, node: Staging,
        snapshots: Snapshots, health: HealthView, limits: VolumeLimits, copies: CopyEnds, peers: CopyPeerList,
    ) -> None:
        self.copies = copies
        self.peers = peers
        self.health = health
        self.limits = limits
        self.snapshots = snapshots
        self.config = config
        self.catalog = catalog
        self.qsd = qsd
        self.daemon = qsd.first  # the node's one QSD unless it has several shards
        self.volumes = volumes
        self.pools = volumes.pools
        self.node = node
        self.changed_blocks = ChangedBlocks(catalog, config.qemu_img)

    def ready(self) -> bool:
        return self.qsd.ready and self.catalog.usable()


def node_features() -> dict[str, bool]:
    return {"fuse": Path("/dev/fuse").exists(), "vhost-user-blk": True}


def attaching(pools: list[Pool], rebuild: Callable[[int], Rebuild],
              prepare: Callable[[QSDClient], Awaitable[None]] | None = None) -> Callable[[int], Rebuild]:
    """Each shard's graph rebuild; in shard 0, each pool attaches first (a fresh QSD has nothing open).

    A device pool opens what its volumes stand on; one process owns a device, so device pools live
    in shard 0 only (`csi_qsd.node.placement`). The file pool asks how QSD can read and write its
    images: every shard runs the same QSD.
    `prepare` runs first in every shard (the TLS credentials of copies from other nodes).
    """
    def for_shard(shard: int) -> Rebuild:
        async def run(client: QSDClient) -> Callable[[], Awaitable[None]] | None:
            if prepare is not None:
                await prepare(client)
            if shard == 0:
                for pool in pools:
                    await pool.attach(client)
            return await rebuild(shard)(client)
        return run
    return for_shard


async def placed(catalog: Catalog, qsd: QSDShards) -> None:
    """Tell the shards which serves each staged volume; refuse to start without a shard a stage row names."""
    for stage in await catalog.stages():
        if stage.shard >= qsd.count:
            raise StartupError(
                f"volume {stage.volume_id} is staged on QSD shard {stage.shard}, but --qsd-shards is {qsd.count}: "
                f"start with --qsd-shards {stage.shard + 1} or more, unstage the volume, then lower it")
        qsd.place(stage.volume_id, stage.shard)


@contextlib.asynccontextmanager
async def running_driver(config: Config) -> AsyncIterator[Driver]:
    """The driver's domain, reconciled and connected to QSD, without the gRPC server."""
    for directory in (config.state_dir, config.qsd_dir, config.exports_dir):
        directory.mkdir(parents=True, exist_ok=True)
    os.chmod(config.state_dir, 0o700)
    failpoints = Failpoints.parse(config.failpoints)
    pool_dir = pool_directory(config.managed_pool, config.pool, config.state_dir, failpoints)
    await pool_dir.ready()  # before anything reads or writes the pool: a managed one is mounted here
    log.info("event=pool_directory pool_dir=%s", pool_dir.describe())
    pool = FilePool(config.pool, config.qemu_img, aio_probe=config.qsd_dir / "aio-probe", file_io=config.file_io)
    pool.prepare()
    async with Catalog(config.catalog_path) as catalog:
        locks = KeyedLocks("volume")
        device_pools = {
            p.id: p for p in await open_device_pools(config.device_pools, catalog, config.state_dir, failpoints,
                                                     remote=config.remote_pools)}
        volumes = Volumes(catalog, pool, locks, failpoints, pools=device_pools)
        await volumes.reconcile()
        qsd = QSDShards(config, config.qsd_shards)
        await placed(catalog, qsd)
        await qsd.stop_beyond()
        keys = KeyStore(config.runtime_dir / volume_keys.KEYS_DIR)
        held = {stage.volume_id for stage in await catalog.stages()} | {  # and encrypted copies' while they fill
            copy.volume_id for copy in await catalog.copies(CopyRole.TARGET)}
        await asyncio.to_thread(keys.keep_only, held)
        exports = ExportPaths(ExportHost(qsd, config.exports_dir, {pool.id: pool, **device_pools}, failpoints,
                                         before_open=CopyLinkCheck(catalog), keys=keys))
        snapshots = Snapshots(catalog, pool, volumes, LiveImages(catalog, exports), locks, failpoints, keys=keys)
        node = Staging(catalog, pool, exports, locks, failpoints, on_unstaged=snapshots.flatten_later)
        healer = pod_healer(config)
        if healer is not None:  # before QSD starts: its first rebuild may cut pods off already
            node.cut_off.listen(healer.heal_later)
        await snapshots.reconcile()
        if config.metadata_tls is not None:
            await prepare_runtime_dir(config.runtime_dir)
        peer_list = known_peers(config)
        peers = CopyPeerNodes(peer_list, config.metadata_tls, config.node_id)
        copies = copy_ends(config, catalog, pool, exports, locks, snapshots, volumes, peers)
        snapshots.before_delete = copies.sources.refuse_snapshot_delete
        volumes.before_delete = copies.sources.refuse_volume_delete
        await copies.targets.reconcile()
        await copies.sources.reconcile()
        await qsd.start(attaching([pool, *device_pools.values()], node.rebuild, copies.fill.prepare))
        try:
            copies.sources.start_expiry()
            yield Driver(config, catalog, qsd, volumes, node, snapshots, HealthView(catalog, exports, node.stalled),
                         VolumeLimits(catalog, qsd, locks, KeyRotation(catalog, pool, qsd, keys)), copies, peer_list)
        finally:
            if healer is not None:
                await healer.close()
            await node.close()
            await copies.fill.close()
            await copies.sources.close()
            await peers.close()
            await snapshots.close()
            await volumes.close()
            await qsd.close()


def copy_ends(config: Config, catalog: Catalog, pool: FilePool, exports: ExportPaths, locks: KeyedLocks,
              snapshots: Snapshots, volumes: Volumes, peers: CopyPeerNodes) -> CopyEnds:
    """Both ends of copies across nodes, on this node's --copy-* settings and TLS files."""
    tls = config.metadata_tls
    settings = CopySettings(
        state_dir=config.state_dir, host=config.copy_host, ports=config.copy_ports,
        tls=(tls.cert, tls.key, tls.ca) if tls is not None else None, qemu_nbd=bundled("qemu-nbd"),
        qemu_img=config.qemu_img, rate=config.copy_rate, lease_ttl=config.copy_lease_ttl,
        leases_per_node=config.copy_leases_per_node, runtime_dir=config.runtime_dir)
    fill = CopyFill(catalog, exports, locks, peers, settings)
    targets = CopyTargets(catalog, pool, peers, settings, volumes.name_locks, on_copy=fill.start,
                          keys=exports.host.keys)
    return CopyEnds(targets, CopySources(catalog, snapshots, settings, locks), fill)


async def prepare_runtime_dir(runtime_dir: Path) -> None:
    """Make the runtime directory and empty it of what a killed load left; warn unless it is on tmpfs."""
    for path in await asyncio.to_thread(runtime.prepare, runtime_dir):
        log.info("event=runtime_leftover_removed path=%s", path)
    filesystem = await asyncio.to_thread(mounts.filesystem_of, runtime_dir)
    if filesystem not in runtime.MEMORY_FILESYSTEMS:
        log.warning("event=runtime_dir_on_disk runtime_dir=%s filesystem=%s hint=QEMU's copies of this node's TLS "
                    "files pass through it while QEMU loads them: mount tmpfs there (deploy/node.yaml: an emptyDir "
                    "of medium Memory)", runtime_dir, filesystem or "unknown")


def known_peers(config: Config) -> CopyPeerList:
    """The other node plugins as this node finds them: listed by --peer, or in the Kubernetes API."""
    if not config.peers_from_pods:
        return StaticCopyPeers(config.peers)
    return PodCopyPeers(in_cluster(config), config.peers_from_pods, config.metadata_port)


def pod_healer(config: Config) -> PodHealer | None:
    """Who tells (and restarts) the pods a rebuild cut off: in a pod only; outside one, the condition says so."""
    if not config.kubernetes_api:
        return None
    return PodHealer(in_cluster(config), config.node_id, config.driver_name, delete=config.delete_pods_on_rebuild)


def in_cluster(config: Config) -> InCluster:
    """This pod's way to its API server (`config.kubernetes_api`, HOST:PORT) with its service account."""
    host, _, port = config.kubernetes_api.rpartition(":")
    return InCluster.from_pod(host.strip("[]"), port)


@contextlib.asynccontextmanager
async def serving(config: Config, observers: RpcObservers | None = None) -> AsyncIterator[Driver]:
    """A driver answering CSI calls on its endpoint until the context exits; `observers` hear of every call."""
    async with running_driver(config) as driver:
        server = grpc.aio.server()
        identity = IdentityService(
            config.driver_name, driver.ready, lambda: features.live_resize_reaches_guest(driver.qsd.version),
            observers)
        controller = ControllerService(config, driver.volumes, driver.snapshots, driver.health, driver.limits, observers,
                                       copies=driver.copies)
        metadata = SnapshotMetadataService(driver.changed_blocks, observers)
        pb_grpc.add_IdentityServicer_to_server(identity, server)
        pb_grpc.add_ControllerServicer_to_server(controller, server)
        pb_grpc.add_GroupControllerServicer_to_server(GroupControllerService(driver.snapshots, observers), server)
        pb_grpc.add_NodeServicer_to_server(NodeService(config, driver.node, node_features(), observers), server)
        pb_grpc.add_SnapshotMetadataServicer_to_server(metadata, server)
        server.add_generic_rpc_handlers((copy_leases_handler(driver.copies.sources),))  # the operator's, here only
        async with unix_socket.serving(server, config.endpoint):
            log.info("event=serving endpoint=%s node_id=%s pool=%s", config.endpoint, config.node_id, config.pool)
            async with serving_metadata_listener(config, identity, controller, metadata,
                                                 handlers=(copy_handler(driver.copies.sources, driver.peers,
                                                                          config.copy_calls_per_node),),
                                                 peers=driver.peers):
                async with claiming_snapshot_contents(config, driver):
                    yield driver


@contextlib.asynccontextmanager
async def claiming_snapshot_contents(config: Config, driver: Driver) -> AsyncIterator[None]:
    """With --claim-snapshot-contents, label the hand-made contents of this node's snapshots while serving."""
    if not config.claim_snapshot_contents:
        yield
        return

    async def holds(snapshot_id: str) -> bool:
        return await driver.snapshots.get(snapshot_id) is not None

    claimer = ContentClaimer(in_cluster(config), config.driver_name, config.node_id, holds)
    task = asyncio.create_task(claimer.run(), name="claim-snapshot-contents")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
