"""Prometheus metrics: RPCs, QSD restarts, pool capacity and per-volume I/O from QSD.

Per-volume counters come from QMP `query-blockstats`, read fresh on every
scrape (the asyncio HTTP handler awaits them, then renders the registry), so
nothing polls in the background. The registry is per driver, not global.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from csi_qsd.config import Config
from csi_qsd.csi import errors as rpc_errors
from csi_qsd.errors import QSDError
from csi_qsd.qsd import graph
from csi_qsd.server import Driver

log = logging.getLogger(__name__)

_IO_FIELDS = (
    ("rd_bytes", "read_bytes", "Bytes read by the volume's consumers"),
    ("wr_bytes", "write_bytes", "Bytes written by the volume's consumers"),
    ("rd_operations", "read_ops", "Read requests"),
    ("wr_operations", "write_ops", "Write requests"),
    ("flush_operations", "flush_ops", "Flush requests"),
)
_TIME_FIELDS = (
    ("rd_total_time_ns", "read_seconds", "Total time spent in reads"),
    ("wr_total_time_ns", "write_seconds", "Total time spent in writes"),
    ("flush_total_time_ns", "flush_seconds", "Total time spent in flushes"),
)


class DriverCollector(Collector):
    """Renders the last snapshot taken by `refresh`."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._stats: dict[str, dict[str, Any]] = {}
        self._volume_count = 0

    async def refresh(self) -> None:
        self._stats = {}
        self._volume_count = len(await self._driver.catalog.volumes())
        if not self._driver.daemon.ready:
            return
        try:
            raw = await self._driver.daemon.client.blockstats()
        except QSDError as exc:
            log.warning("event=metrics_blockstats_failed error=%r", str(exc))
            return
        for entry in raw:
            node = entry.get("node-name", "")
            volume_id = graph.volume_of(node)
            if volume_id is not None and node == graph.nodes_for(volume_id).format:
                self._stats[volume_id] = entry.get("stats", {})

    def collect(self) -> Iterator[Metric]:
        usage = self._driver.volumes.available_bytes()
        yield GaugeMetricFamily("csi_qsd_pool_available_bytes", "Free bytes in the volume pool", value=usage)
        yield GaugeMetricFamily("csi_qsd_volumes", "Volumes in the catalog", value=self._volume_count)
        yield CounterMetricFamily("csi_qsd_qsd_restarts", "Times qemu-storage-daemon was lost and brought back",
                                  value=self._driver.daemon.restarts)
        yield GaugeMetricFamily("csi_qsd_qsd_ready", "1 while qemu-storage-daemon answers",
                                value=1 if self._driver.daemon.ready else 0)
        for field, name, text in _IO_FIELDS:
            family = CounterMetricFamily(f"csi_qsd_volume_{name}", text, labels=["volume_id"])
            for volume_id, stats in sorted(self._stats.items()):
                family.add_metric([volume_id], float(stats.get(field, 0)))
            yield family
        for field, name, text in _TIME_FIELDS:
            family = CounterMetricFamily(f"csi_qsd_volume_{name}", text, labels=["volume_id"])
            for volume_id, stats in sorted(self._stats.items()):
                family.add_metric([volume_id], float(stats.get(field, 0)) / 1e9)
            yield family


class Metrics:
    """The driver's registry: RPC counters and the driver collector."""

    def __init__(self, driver: Driver) -> None:
        self.registry = CollectorRegistry()
        self.collector = DriverCollector(driver)
        self.registry.register(self.collector)
        self.rpcs = Counter("csi_qsd_rpc", "CSI calls by method and result code", ["method", "code"],
                            registry=self.registry)
        self.latency = Histogram("csi_qsd_rpc_duration_seconds", "CSI call latency", ["method"],
                                 registry=self.registry,
                                 buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120))

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.rpcs.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)

    async def render(self) -> bytes:
        await self.collector.refresh()
        return generate_latest(self.registry)


async def _handle(metrics: Metrics, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/"
        if path.split(b"?")[0] in (b"/metrics", b"/"):
            body, status = await metrics.render(), b"200 OK"
        elif path == b"/healthz":
            body, status = b"ok\n", b"200 OK"
        else:
            body, status = b"not found\n", b"404 Not Found"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                     + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def serving_metrics(config: Config, driver: Driver) -> AsyncIterator[Metrics | None]:
    """Serve /metrics on `config.metrics_address` while the context is open (nothing if unset)."""
    if not config.metrics_address:
        yield None
        return
    metrics = Metrics(driver)
    host, _, port = config.metrics_address.rpartition(":")
    server = await asyncio.start_server(lambda r, w: _handle(metrics, r, w), host or None, int(port))
    rpc_errors.add_observer(metrics.observe)
    log.info("event=metrics_serving address=%s", config.metrics_address)
    try:
        yield metrics
    finally:
        rpc_errors.remove_observer(metrics.observe)
        server.close()
        await server.wait_closed()
