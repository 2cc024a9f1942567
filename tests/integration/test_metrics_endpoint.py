"""The /metrics endpoint of a served driver, scraped over HTTP while a pod writes.

The driver runs as `csi-qsd serve --metrics-address …`, as in its pod. A
filesystem volume is created, staged and published; data is written with
fsync while /metrics is scraped; the per-volume counters (the kernel's, of the
volume's loop device) must grow by at least what was written. RPC counts and
latency by method and code, pool capacity and the QSD restart counter (across
a `kill -9` of QSD) are checked on the same endpoint; a device pool's
capacity beside the file pool's in `test_device_pool.py`.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from testing.harness import DriverProcess, Sandbox, free_port, qsd_pid, running_driver, until
from testing.helpers.metrics_scrape import Scrape, scrape

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
DOCUMENTED_IN = (REPO / "deploy" / "README.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))


def write_synced_chunks(path: Path, chunks: int, chunk: int) -> int:
    """Write `chunks` random chunks, fsync after each; return the bytes written."""
    with open(path, "wb") as handle:
        for _ in range(chunks):
            handle.write(os.urandom(chunk))
            handle.flush()
            os.fsync(handle.fileno())
    return chunks * chunk


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
async def process(box: Sandbox, port: int) -> AsyncIterator[DriverProcess]:
    async with running_driver(box, "--metrics-address", f"127.0.0.1:{port}") as driver:
        yield driver


async def wait_for(port: int, check: str, predicate: Callable[[Scrape], bool], timeout: float = 60.0) -> Scrape:
    """Scrape until `predicate(scrape)` holds; fail with the last scrape after `timeout`."""
    last: list[Scrape] = []

    async def reached() -> Scrape | None:
        last[:] = [await scrape(port)]
        return last[0] if predicate(last[0]) else None

    found = await until(reached, lambda: f"{check}; last scrape:\n{last[0].text if last else ''}", timeout, 0.2)
    assert found is not None
    return found


async def test_metrics_during_io_and_a_qsd_restart(box: Sandbox, process: DriverProcess, port: int) -> None:
    async with CSIClient(box.endpoint, timeout=60) as csi:
        volume = await csi.create_volume("pvc-metrics", 256 * MIB, fs_type="ext4")
        vid = volume.volume_id
        staging, target = box.staging("metrics"), box.target("metrics-pod")
        await csi.stage(vid, str(staging), fs_type="ext4")
        await csi.publish(vid, str(staging), str(target), fs_type="ext4")
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await csi.create_volume("pvc-bad", MIB, {"noSuchParameter": "1"})
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT

        before = await scrape(port)
        assert before.value("csi_qsd_volume_staged", volume_id=vid) == 1
        devices = before.matching("csi_qsd_volume_write_bytes_total", volume_id=vid)
        assert len(devices) == 1 and devices[0]["device"].startswith("loop"), devices
        written_before = before.total("csi_qsd_volume_write_bytes_total", volume_id=vid)

        # Write while scraping: every scrape parses, and the counter never goes back.
        writer = asyncio.create_task(asyncio.to_thread(write_synced_chunks, target / "data.bin", 24, MIB))
        seen = [written_before]
        try:
            while not writer.done():
                during = await scrape(port)
                seen.append(during.total("csi_qsd_volume_write_bytes_total", volume_id=vid))
                await asyncio.sleep(0.05)
        finally:
            written = await writer
        after = await scrape(port)
        seen.append(after.total("csi_qsd_volume_write_bytes_total", volume_id=vid))
        assert seen == sorted(seen), f"write bytes went backwards: {seen}"
        assert len(seen) >= 3, "no scrape happened while the pod was writing"
        assert seen[-1] - written_before >= written, (written_before, seen[-1], written)
        assert after.total("csi_qsd_volume_write_ops_total", volume_id=vid) > before.total(
            "csi_qsd_volume_write_ops_total", volume_id=vid)
        assert after.total("csi_qsd_volume_write_seconds_total", volume_id=vid) > 0
        assert after.total("csi_qsd_volume_flush_ops_total", volume_id=vid) > 0  # fsync reached the device
        assert after.types["csi_qsd_volume_write_bytes"] == "counter"
        assert "no I/O counters" in after.text and "QSD 7.2 offers none per export" in after.text

        # From QSD: only what it really reports per node.
        assert after.value("csi_qsd_volume_write_highest_offset_bytes", volume_id=vid) > 0
        assert after.value("csi_qsd_volume_allocated_bytes", volume_id=vid) >= written
        assert after.value("csi_qsd_volume_capacity_bytes", volume_id=vid) == 256 * MIB
        assert after.value("csi_qsd_volume_info", volume_id=vid, name="pvc-metrics", export="filesystem",
                           format="qcow2") == 1

        # Every metric the operator documentation names is served.
        for doc in DOCUMENTED_IN:
            for name in set(re.findall(r"\bcsi_qsd_[a-z_]+", doc.read_text())):
                assert name in after.samples or name in after.types, f"{doc.name} names {name}, not served"

        # RPCs by method and code, with latency.
        for method in ("CreateVolume", "NodeStageVolume", "NodePublishVolume"):
            assert after.value("csi_qsd_rpcs_total", method=method, code="OK") >= 1
            assert after.value("csi_qsd_rpc_duration_seconds_count", method=method, code="OK") >= 1
            assert after.value("csi_qsd_rpc_duration_seconds_bucket", method=method, code="OK", le="+Inf") >= 1
            assert after.value("csi_qsd_rpc_duration_seconds_sum", method=method, code="OK") > 0
        assert after.value("csi_qsd_rpcs_total", method="CreateVolume", code="INVALID_ARGUMENT") == 1
        assert after.value("csi_qsd_rpc_duration_seconds_count", method="CreateVolume", code="INVALID_ARGUMENT") == 1
        assert after.types["csi_qsd_rpc_duration_seconds"] == "histogram"

        # Pool capacity, by pool ID: here only the file pool.
        assert after.matching("csi_qsd_pool_capacity_bytes") == [{"pool": "default"}]
        size = after.value("csi_qsd_pool_capacity_bytes", pool="default")
        assert 0 < after.value("csi_qsd_pool_available_bytes", pool="default") <= size
        assert after.value("csi_qsd_pool_provisioned_bytes", pool="default") == 256 * MIB
        assert after.value("csi_qsd_volumes") == 1

        # QSD restarts: 0, then 1 after kill -9 (the driver starts a new QSD and rebuilds).
        assert after.value("csi_qsd_qsd_restarts_total", shard="0") == 0
        assert after.value("csi_qsd_qsd_ready", shard="0") == 1
        pid = qsd_pid(box)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        restarted = await wait_for(
            port, "csi_qsd_qsd_restarts_total == 1 and ready",
            lambda s: s.value("csi_qsd_qsd_restarts_total", shard="0") == 1 and s.value("csi_qsd_qsd_ready", shard="0") == 1
            and len(s.matching("csi_qsd_volume_write_bytes_total", volume_id=vid)) == 1,
        )
        assert qsd_pid(box) not in (None, pid)
        assert restarted.value("csi_qsd_volume_staged", volume_id=vid) == 1

        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        await csi.delete_volume(vid)
        final = await scrape(port)
        assert final.value("csi_qsd_volumes") == 0
        assert not final.matching("csi_qsd_volume_write_bytes_total", volume_id=vid)
        for method in ("NodeUnpublishVolume", "NodeUnstageVolume", "DeleteVolume"):
            assert final.value("csi_qsd_rpcs_total", method=method, code="OK") >= 1


async def test_other_paths(process: DriverProcess, port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    health = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert health.startswith(b"HTTP/1.1 200 OK") and health.endswith(b"ok\n")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    missing = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert missing.startswith(b"HTTP/1.1 404")
