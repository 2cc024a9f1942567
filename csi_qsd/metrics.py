"""Prometheus metrics: CSI calls, QSD restarts, each pool's capacity and per-volume I/O.

Where each per-volume figure comes from, and why (measured on QSD 7.2):

* QSD's `query-blockstats` does not account I/O on export BlockBackends: they
  are anonymous, so they are skipped, and the node-level entries carry only
  `wr_highest_offset`; their read/write/flush counters stay zero whatever the
  volume's consumers do. Those counters are therefore not exported here.
* Filesystem and block volumes reach their pod through a FUSE export and a
  loop device. The kernel counts the I/O on that loop device
  (`/sys/block/loopN/stat`), so those are the per-volume counters: requests,
  bytes and time, labelled with the volume ID and the loop device (a QSD
  restart or a re-stage gives a new device, and with it a new series).
* vhost-user-blk volumes have no I/O counters at all: the guest talks to QSD
  directly, and QSD 7.2 has no per-export statistics.
* From QSD we keep what it really reports per node: the highest offset
  written through the volume's top node (a gauge, for every kind of export).
* Capacity and allocated bytes are asked of each pool the driver has,
  through the `Pool` interface, and labelled with the pool's ID: a file
  pool answers from its filesystem and its image files (`st_blocks`, the
  number QEMU reports as `actual-size`), a device pool from its extents.
  Neither costs a QMP call.

Everything is read fresh on each scrape (the HTTP handler awaits the reads,
then renders the registry), so nothing polls in the background; the registry
belongs to one driver, not to the process. This module builds no gRPC
messages: RPC figures arrive as (method, code, seconds) from the observer hook
of the RPC layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from csi_qsd.catalog import StageRecord, StageState, VolumeRecord, VolumeState
from csi_qsd.config import Config
from csi_qsd.csi.errors import RpcObservers
from csi_qsd.errors import QSDError, StartupError
from csi_qsd.exports import fuse_loop
from csi_qsd.pools.base import Pool, PoolUsage
from csi_qsd.qsd import features
from csi_qsd.qsd import stats as qsd_stats
from csi_qsd.qsd.daemon import QSDState
from csi_qsd.sys import text_http

if TYPE_CHECKING:
    from csi_qsd.server import Driver

log = logging.getLogger(__name__)

SECTOR_BYTES = 512  # /sys/block/*/stat counts 512-byte sectors whatever the device's block size
SYS_BLOCK = Path("/sys/block")
RPC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

_LOOP_HELP = (
    " (kernel counters of the volume's loop device, /sys/block/loopN/stat; filesystem and block volumes "
    "only: vhost-user-blk volumes have no I/O counters, QSD 7.2 offers none per export)"
)


@dataclasses.dataclass(frozen=True)
class DiskStat:
    """The fields of a /sys/block/<dev>/stat line we export (Documentation/block/stat.rst)."""

    read_ios: int
    read_sectors: int
    read_ms: int
    write_ios: int
    write_sectors: int
    write_ms: int
    in_flight: int
    io_ms: int
    discard_ios: int = 0
    discard_sectors: int = 0
    discard_ms: int = 0
    flush_ios: int = 0
    flush_ms: int = 0


def parse_disk_stat(text: str) -> DiskStat:
    """Parse one stat line (11, 15 or 17 fields, by kernel age); raise ValueError if it is not one."""
    fields = [int(word) for word in text.split()]
    if len(fields) < 11:
        raise ValueError(f"a block stat line has at least 11 fields, got {len(fields)}: {text!r}")
    padded = fields + [0] * (17 - len(fields))
    return DiskStat(
        read_ios=padded[0], read_sectors=padded[2], read_ms=padded[3],
        write_ios=padded[4], write_sectors=padded[6], write_ms=padded[7],
        in_flight=padded[8], io_ms=padded[9],
        discard_ios=padded[11], discard_sectors=padded[13], discard_ms=padded[14],
        flush_ios=padded[15], flush_ms=padded[16],
    )


def read_loop_stat(device: Path, backing_file: Path, sys_block: Path = SYS_BLOCK) -> DiskStat | None:
    """The counters of loop `device` if it still serves `backing_file`, else None.

    Loop numbers are reused: a device the catalog remembers may since have
    been detached (QSD restart, crash) and attached to something else, so the
    backing file is checked before its counters are believed.
    """
    name = device.name
    if not name.startswith("loop"):
        return None
    base = sys_block / name
    try:
        backing = (base / "loop" / "backing_file").read_text().strip().removesuffix(" (deleted)")
        if Path(backing) != backing_file:
            return None
        return parse_disk_stat((base / "stat").read_text())
    except (OSError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class LoopSample:
    volume_id: str
    device: str
    stat: DiskStat


@dataclasses.dataclass(frozen=True)
class Sample:
    """Everything one scrape shows, taken before rendering so rendering never waits."""

    pools: Mapping[str, PoolUsage] = dataclasses.field(default_factory=dict)
    volumes: tuple[VolumeRecord, ...] = ()
    staged: frozenset[str] = frozenset()
    allocated: Mapping[str, int] = dataclasses.field(default_factory=dict)
    loops: tuple[LoopSample, ...] = ()
    highest_offset: Mapping[str, int] = dataclasses.field(default_factory=dict)


def _loop_devices(stages: Iterable[StageRecord], publish_loops: Mapping[str, list[str]]) -> list[tuple[str, str]]:
    """(volume ID, device) of every loop device the catalog says a volume uses."""
    found: list[tuple[str, str]] = []
    for stage in stages:
        devices = [stage.loop_device] if stage.loop_device else []
        devices += publish_loops.get(stage.volume_id, [])
        found.extend((stage.volume_id, device) for device in dict.fromkeys(devices))
    return found


def pool_usages(pools: Mapping[str, Pool]) -> dict[str, PoolUsage]:
    """Each pool's capacity by ID; a pool that cannot say now is left out of the scrape, and logged."""
    usages: dict[str, PoolUsage] = {}
    for pool_id, pool in pools.items():
        try:
            usages[pool_id] = pool.usage()
        except OSError as exc:
            log.warning("event=metrics_pool_unreadable pool=%s error=%r", pool_id, str(exc))
    return usages


async def allocated_bytes(pools: Mapping[str, Pool], volumes: Iterable[VolumeRecord]) -> dict[str, int]:
    """Bytes each volume occupies, asked of the pool that holds it, by volume ID.

    A volume deleted meanwhile, or in a pool this driver is not configured
    with, is left out; so is every volume of a pool that cannot be read now
    (logged).
    """
    by_pool: dict[str, dict[Path, str]] = {}
    for volume in volumes:
        by_pool.setdefault(volume.pool, {})[volume.image] = volume.id
    allocated: dict[str, int] = {}
    for pool_id, images in by_pool.items():
        pool = pools.get(pool_id)
        if pool is None:
            continue
        try:
            sizes = await pool.allocated(list(images))
        except OSError as exc:
            log.warning("event=metrics_pool_unreadable pool=%s error=%r", pool_id, str(exc))
            continue
        allocated.update((images[image], size) for image, size in sizes.items())
    return allocated


class DriverCollector(Collector):
    """Renders the sample taken by the last `refresh`."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._sample = Sample()

    async def refresh(self) -> None:
        """Read the catalog, sysfs, the pools and QSD; never raises for a sick QSD or an unreadable pool."""
        catalog = self._driver.catalog
        volumes = tuple(await catalog.volumes(state=VolumeState.READY))
        stages = [s for s in await catalog.stages() if s.state is StageState.STAGED]
        publish_loops: dict[str, list[str]] = {}
        for publish in await catalog.publishes():
            if publish.loop_device:
                publish_loops.setdefault(publish.volume_id, []).append(publish.loop_device)
        pairs = _loop_devices(stages, publish_loops)
        backing = {vid: fuse_loop.export_file(self._driver.config.exports_dir, vid) for vid, _ in pairs}

        def read_loops() -> tuple[LoopSample, ...]:
            loops = []
            for volume_id, device in pairs:
                stat = read_loop_stat(Path(device), backing[volume_id])
                if stat is not None:
                    loops.append(LoopSample(volume_id, Path(device).name, stat))
            return tuple(loops)

        pools = self._driver.pools
        self._sample = Sample(
            pools=pool_usages(pools), volumes=volumes, staged=frozenset(s.volume_id for s in stages),
            allocated=await allocated_bytes(pools, volumes), loops=await asyncio.to_thread(read_loops),
            highest_offset=await self._highest_offsets(),
        )

    async def _highest_offsets(self) -> dict[str, int]:
        """wr_highest_offset of each exported volume's top node (every shard), the one per-node figure QSD 7.2 keeps."""
        found: dict[str, int] = {}
        for index, daemon in enumerate(self._driver.qsd.daemons):
            if not daemon.ready:
                continue
            try:
                tops = await qsd_stats.volume_top_stats(daemon.client)
            except QSDError as exc:
                log.warning("event=metrics_qsd_failed shard=%d error=%r", index, str(exc))
                continue
            found.update({volume_id: node["wr_highest_offset"] for volume_id, node in tops.items()})
        return found

    def _qsd_families(self) -> Iterator[Metric]:
        """Each QSD shard's supervision figures, labelled by shard ("0" on a node with one QSD)."""
        restarts = CounterMetricFamily("csi_qsd_qsd_restarts",
                                       "Times qemu-storage-daemon was lost and the driver brought it back",
                                       labels=["shard"])
        ready = GaugeMetricFamily("csi_qsd_qsd_ready", "1 while qemu-storage-daemon answers over QMP",
                                  labels=["shard"])
        state = GaugeMetricFamily(
            "csi_qsd_qsd_state",
            "1 for the supervised qemu-storage-daemon's current runstate, 0 for the others "
            "(starting, running, wedged, restarting, stopped)", labels=["shard", "state"])
        wedges = CounterMetricFamily("csi_qsd_qsd_wedges",
                                     "Times qemu-storage-daemon stopped answering over QMP and was killed and replaced",
                                     labels=["shard"])
        for index, daemon in enumerate(self._driver.qsd.daemons):
            shard = str(index)
            restarts.add_metric([shard], daemon.restarts)
            ready.add_metric([shard], 1 if daemon.ready else 0)
            for runstate in QSDState:
                state.add_metric([shard, runstate.value], 1 if daemon.runstate is runstate else 0)
            wedges.add_metric([shard], daemon.wedges)
        yield from (restarts, ready, state, wedges)

    def collect(self) -> Iterator[Metric]:
        """Every family from the last `refresh`'s sample, as the Prometheus client renders a scrape.

        Synchronous (the client's interface), so it reads only the sample,
        never the catalog, QSD or a pool: `Metrics.render` awaits `refresh`
        first, under one lock, so a scrape waits on the event loop, never
        in here, and never mixes two samples.
        """
        sample, daemon = self._sample, self._driver.daemon
        yield from self._pool_families(sample)
        yield GaugeMetricFamily("csi_qsd_volumes", "Volumes in the catalog", value=len(sample.volumes))
        yield from self._qsd_families()
        yield CounterMetricFamily("csi_qsd_snapshot_metadata_fallbacks",
                                  "GetMetadataDelta answers that were a superset (everything allocated in either "
                                  "snapshot) because a flatten had merged the images between base and target",
                                  value=self._driver.changed_blocks.fallbacks)
        data_path = GaugeMetricFamily(
            "csi_qsd_data_path_info",
            "1, labelled with QSD's version and the loop-device I/O mode new container volumes get "
            "(direct where QSD's FUSE export keeps parallel writes intact, else buffered)",
            labels=["qsd_version", "loop_io", "setting"])
        data_path.add_metric([".".join(map(str, daemon.version)), features.describe(daemon.loop_direct_io),
                              self._driver.config.loop_io.value], 1)
        yield data_path

        info = GaugeMetricFamily("csi_qsd_volume_info", "One per volume: its CSI name (the PV name), export and format",
                                 labels=["volume_id", "name", "export", "format"])
        capacity = GaugeMetricFamily("csi_qsd_volume_capacity_bytes", "Size of the volume as its consumer sees it",
                                     labels=["volume_id"])
        staged = GaugeMetricFamily("csi_qsd_volume_staged", "1 while the volume is staged on this node",
                                   labels=["volume_id"])
        allocated = GaugeMetricFamily("csi_qsd_volume_allocated_bytes",
                                      "Bytes the volume occupies in its pool (an image file's st_blocks; a device "
                                      "pool's extent, allocated whole)", labels=["volume_id"])
        for volume in sample.volumes:
            info.add_metric([volume.id, volume.name, volume.params.export.value, volume.params.format.value], 1)
            capacity.add_metric([volume.id], volume.capacity)
            staged.add_metric([volume.id], 1 if volume.id in sample.staged else 0)
            if volume.id in sample.allocated:
                allocated.add_metric([volume.id], sample.allocated[volume.id])
        yield from (info, capacity, staged, allocated)

        offset = GaugeMetricFamily(
            "csi_qsd_volume_write_highest_offset_bytes",
            "Highest offset written through the volume's top node since QSD opened it (from query-blockstats; "
            "every export kind, vhost-user-blk included; resets when QSD restarts)",
            labels=["volume_id"],
        )
        for volume_id, value in sorted(sample.highest_offset.items()):
            offset.add_metric([volume_id], value)
        yield offset

        yield from self._loop_families(sample.loops)

    @staticmethod
    def _pool_families(sample: Sample) -> Iterator[Metric]:
        """Capacity, free and provisioned bytes of each pool, labelled by its ID."""
        labels = ["pool"]
        capacity = GaugeMetricFamily(
            "csi_qsd_pool_capacity_bytes",
            "Bytes the pool can hold: a file pool's filesystem, a device pool's data area", labels=labels)
        available = GaugeMetricFamily(
            "csi_qsd_pool_available_bytes", "Free bytes in the pool (what GetCapacity reports for it)",
            labels=labels)
        for pool_id, usage in sorted(sample.pools.items()):
            capacity.add_metric([pool_id], usage.total)
            available.add_metric([pool_id], usage.available)
        provisioned = GaugeMetricFamily(
            "csi_qsd_pool_provisioned_bytes",
            "Sum of the capacities of the pool's volumes (a file pool's are thin: it may exceed the pool)",
            labels=labels)
        by_pool = dict.fromkeys(sample.pools, 0)
        for volume in sample.volumes:
            by_pool[volume.pool] = by_pool.get(volume.pool, 0) + volume.capacity
        for pool_id, total in sorted(by_pool.items()):
            provisioned.add_metric([pool_id], total)
        yield from (capacity, available, provisioned)

    @staticmethod
    def _loop_families(loops: tuple[LoopSample, ...]) -> Iterator[Metric]:
        labels = ["volume_id", "device"]
        counters: list[tuple[str, str, str, float]] = [
            ("read_ops", "Read requests completed", "read_ios", 1),
            ("write_ops", "Write requests completed", "write_ios", 1),
            ("read_bytes", "Bytes read", "read_sectors", SECTOR_BYTES),
            ("write_bytes", "Bytes written", "write_sectors", SECTOR_BYTES),
            ("read_seconds", "Time spent on reads, summed over requests", "read_ms", 1e-3),
            ("write_seconds", "Time spent on writes, summed over requests", "write_ms", 1e-3),
            ("discard_ops", "Discard requests completed", "discard_ios", 1),
            ("discard_bytes", "Bytes discarded", "discard_sectors", SECTOR_BYTES),
            ("flush_ops", "Flush requests completed", "flush_ios", 1),
            ("flush_seconds", "Time spent on flushes, summed over requests", "flush_ms", 1e-3),
            ("io_busy_seconds", "Time the device had I/O in flight", "io_ms", 1e-3),
        ]
        for name, text, field, scale in counters:
            family = CounterMetricFamily(f"csi_qsd_volume_{name}", text + _LOOP_HELP, labels=labels)
            for loop in loops:
                family.add_metric([loop.volume_id, loop.device], getattr(loop.stat, field) * scale)
            yield family
        in_flight = GaugeMetricFamily("csi_qsd_volume_io_in_flight", "Requests in flight" + _LOOP_HELP,
                                      labels=labels)
        for loop in loops:
            in_flight.add_metric([loop.volume_id, loop.device], loop.stat.in_flight)
        yield in_flight


class Metrics:
    """The driver's registry: RPC counters and latency, and the driver collector."""

    def __init__(self, driver: Driver) -> None:
        self.registry = CollectorRegistry()
        self.collector = DriverCollector(driver)
        self.registry.register(self.collector)
        self.rpcs = Counter("csi_qsd_rpcs", "CSI calls by method and gRPC result code", ["method", "code"],
                            registry=self.registry)
        self.latency = Histogram("csi_qsd_rpc_duration_seconds", "CSI call latency by method and gRPC result code",
                                 ["method", "code"], registry=self.registry, buckets=RPC_BUCKETS)
        self._lock = asyncio.Lock()

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.rpcs.labels(method, code).inc()
        self.latency.labels(method, code).observe(seconds)

    async def render(self) -> bytes:
        """Refresh and render as one step, so concurrent scrapes never mix two samples."""
        async with self._lock:
            await self.collector.refresh()
            return generate_latest(self.registry)


EXPOSITION = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format


def _routes(metrics: Metrics) -> dict[str, text_http.Route]:
    async def scrape() -> tuple[HTTPStatus, bytes]:
        try:
            return HTTPStatus.OK, await metrics.render()
        except Exception:
            log.exception("event=metrics_render_failed")
            return HTTPStatus.INTERNAL_SERVER_ERROR, b"metrics unavailable, see the driver log\n"

    async def healthz() -> tuple[HTTPStatus, bytes]:
        return HTTPStatus.OK, b"ok\n"

    return {"/metrics": scrape, "/": scrape, "/healthz": healthz}


@contextlib.asynccontextmanager
async def serving_metrics(
    config: Config, driver: Driver, observers: RpcObservers,
) -> AsyncIterator[Metrics | None]:
    """Serve /metrics on `config.metrics_address` (host:port; empty host: all) while open; nothing if unset.

    Counts the calls that `observers` (the servers' servicers') report.
    """
    if not config.metrics_address:
        yield None
        return
    metrics = Metrics(driver)
    try:
        server = await text_http.start(config.metrics_address, _routes(metrics), EXPOSITION)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot serve metrics on {config.metrics_address!r}: {exc}") from exc
    observers.add(metrics.observe)
    log.info("event=metrics_serving address=%s", config.metrics_address)
    try:
        yield metrics
    finally:
        observers.remove(metrics.observe)
        server.close()
        await server.wait_closed()

