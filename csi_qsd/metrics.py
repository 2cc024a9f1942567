"""Prometheus metrics: CSI calls, QSD restarts, pool capacity and per-volume I/O.

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
  Allocated bytes come from the image file itself (`st_blocks`, the number
  QEMU reports as `actual-size`), which costs a stat and no QMP call.

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
import os
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from csi_qsd.qsd import features
from csi_qsd.exports import fuse_loop
from csi_qsd.catalog import StageRecord, StageState, VolumeRecord, VolumeState
from csi_qsd.config import Config
from csi_qsd.csi.errors import RpcObservers
from csi_qsd.errors import QSDError, StartupError
from csi_qsd.pools.files import FilePool, PoolUsage
from csi_qsd.qsd import stats as qsd_stats
from csi_qsd.qsd.daemon import QSDState

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

    pool: PoolUsage | None = None
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


def _allocated_bytes(images: Mapping[str, Path]) -> dict[str, int]:
    allocated: dict[str, int] = {}
    for volume_id, image in images.items():
        with contextlib.suppress(OSError):
            allocated[volume_id] = os.stat(image).st_blocks * 512
    return allocated


class DriverCollector(Collector):
    """Renders the sample taken by the last `refresh`."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._pool = FilePool(driver.config.pool, driver.config.qemu_img)
        self._sample = Sample()

    async def refresh(self) -> None:
        """Read the catalog, sysfs, the image files and QSD; never raises for a sick QSD."""
        catalog = self._driver.catalog
        volumes = tuple(await catalog.volumes(state=VolumeState.READY))
        stages = [s for s in await catalog.stages() if s.state is StageState.STAGED]
        publish_loops: dict[str, list[str]] = {}
        for publish in await catalog.publishes():
            if publish.loop_device:
                publish_loops.setdefault(publish.volume_id, []).append(publish.loop_device)
        pairs = _loop_devices(stages, publish_loops)
        backing = {vid: fuse_loop.export_file(self._driver.config.exports_dir, vid) for vid, _ in pairs}

        def read_host() -> tuple[PoolUsage | None, dict[str, int], tuple[LoopSample, ...]]:
            try:
                usage: PoolUsage | None = self._pool.usage()
            except OSError:
                usage = None
            allocated = _allocated_bytes({v.id: v.image for v in volumes})
            loops = []
            for volume_id, device in pairs:
                stat = read_loop_stat(Path(device), backing[volume_id])
                if stat is not None:
                    loops.append(LoopSample(volume_id, Path(device).name, stat))
            return usage, allocated, tuple(loops)

        usage, allocated, loops = await asyncio.to_thread(read_host)
        self._sample = Sample(
            pool=usage, volumes=volumes, staged=frozenset(s.volume_id for s in stages), allocated=allocated,
            loops=loops, highest_offset=await self._highest_offsets(),
        )

    async def _highest_offsets(self) -> dict[str, int]:
        """wr_highest_offset of each exported volume's top node, the one per-node figure QSD 7.2 keeps."""
        daemon = self._driver.daemon
        if not daemon.ready:
            return {}
        try:
            tops = await qsd_stats.volume_top_stats(daemon.client)
        except QSDError as exc:
            log.warning("event=metrics_qsd_failed error=%r", str(exc))
            return {}
        return {volume_id: node["wr_highest_offset"] for volume_id, node in tops.items()}

    def collect(self) -> Iterator[Metric]:
        sample, daemon = self._sample, self._driver.daemon
        if sample.pool is not None:
            yield GaugeMetricFamily("csi_qsd_pool_capacity_bytes",
                                    "Size of the filesystem that holds the volume pool", value=sample.pool.total)
            yield GaugeMetricFamily("csi_qsd_pool_available_bytes",
                                    "Free bytes in the volume pool (what GetCapacity reports)",
                                    value=sample.pool.available)
        yield GaugeMetricFamily("csi_qsd_pool_provisioned_bytes",
                                "Sum of the capacities of all volumes (thin: may exceed the pool)",
                                value=sum(v.capacity for v in sample.volumes))
        yield GaugeMetricFamily("csi_qsd_volumes", "Volumes in the catalog", value=len(sample.volumes))
        yield CounterMetricFamily("csi_qsd_qsd_restarts",
                                  "Times qemu-storage-daemon was lost and the driver brought it back",
                                  value=daemon.restarts)
        yield GaugeMetricFamily("csi_qsd_qsd_ready", "1 while qemu-storage-daemon answers over QMP",
                                value=1 if daemon.ready else 0)
        state = GaugeMetricFamily(
            "csi_qsd_qsd_state",
            "1 for the supervised qemu-storage-daemon's current runstate, 0 for the others "
            "(starting, running, wedged, restarting, stopped)", labels=["state"])
        for runstate in QSDState:
            state.add_metric([runstate.value], 1 if daemon.runstate is runstate else 0)
        yield state
        yield CounterMetricFamily("csi_qsd_qsd_wedges",
                                  "Times qemu-storage-daemon stopped answering over QMP and was killed and replaced",
                                  value=daemon.wedges)
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
                                      "Bytes the volume's image file occupies in the pool (st_blocks)",
                                      labels=["volume_id"])
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


async def _handle(metrics: Metrics, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        parts = request.split(b"\r\n", 1)[0].split(b" ")
        method, path = (parts[0], parts[1].split(b"?")[0]) if len(parts) >= 2 else (b"", b"")
        if method not in (b"GET", b"HEAD"):
            body, status = b"method not allowed\n", b"405 Method Not Allowed"
        elif path in (b"/metrics", b"/"):
            try:
                body, status = await metrics.render(), b"200 OK"
            except Exception:
                log.exception("event=metrics_render_failed")
                body, status = b"metrics unavailable, see the driver log\n", b"500 Internal Server Error"
        elif path == b"/healthz":
            body, status = b"ok\n", b"200 OK"
        else:
            body, status = b"not found\n", b"404 Not Found"
        head = (b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        writer.write(head if method == b"HEAD" else head + body)
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


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
    host, _, port = config.metrics_address.rpartition(":")
    try:
        server = await asyncio.start_server(lambda r, w: _handle(metrics, r, w), host.strip("[]") or None, int(port))
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

