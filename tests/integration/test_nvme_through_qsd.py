"""The NVMe way in without VFIO: the pool reaches its device only through QSD, a loop device standing in.

`NvmeDevicePool` never touches its device from the host: the size comes
from QMP, the label and foreign signatures from a read-only FUSE view of
the shared node, scrubs from write-zeroes issued by QSD. Here the shared
node is a `host_device` over a loop device instead of QEMU's `nvme`
driver (no VFIO on these machines), so everything but the driver itself
runs for real: the foreign-data refusal, the label, capacity from QMP,
windows sharing the node, a scrub beside a live window, and the served
driver with the pool: a VM volume's whole lifecycle (growth in place, a QSD
SIGKILL and rebuild with the shared node attached first, the scrub at
delete) and the refusal of other exports.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from csi_qsd import server
from csi_qsd.catalog import Catalog
from csi_qsd.cli.client import CSIClient
from csi_qsd.errors import StartupError
from csi_qsd.params import ExportKind, ImageFormat, VolumeParameters
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pools.block_device import LABEL_MAGIC
from csi_qsd.pools.nvme import NvmeDevicePool
from csi_qsd.qsd import export_nodes, graph
from csi_qsd.qsd.graph import QMPArgs
from csi_qsd.server import Driver
from testing.harness import Sandbox, in_process_driver, qsd_pid, until, wait_new_qsd
from testing.helpers.nvme_pools import DEVICE_BYTES, MIB, PATTERN, FakeNVMe, capacity

VM = VolumeParameters(format=ImageFormat.RAW, export=ExportKind.VHOST_USER_BLK)


@dataclasses.dataclass(frozen=True)
class LoopStandIn:
    """The shared node as a host_device over the fake NVMe: what `NvmeNamespace` is with a real controller."""

    path: Path
    node_name: str

    def base_blockdev(self) -> QMPArgs:
        return {"driver": "host_device", "node-name": self.node_name, "filename": str(self.path),
                "cache": {"direct": True}, "aio": "native", "locking": "off", "discard": "unmap"}

    def child(self, *, read_only: bool) -> str:
        return self.node_name


class StandInPool(NvmeDevicePool):
    """The NVMe pool with its shared node swapped for the stand-in, and udev's verdict taken as given."""

    def __init__(self, catalog: Catalog, view_dir: Path, device: FakeNVMe, force: bool = False) -> None:
        super().__init__(DevicePoolSpec.parse(f"fast=nvme://0000:01:00.0{',force' if force else ''}"),
                         catalog, view_dir)
        self.base = LoopStandIn(device.node, self.namespace.node_name)  # type: ignore[assignment]
        self._host = self.base

    def device_problem(self) -> str:
        return ""


@pytest.fixture
async def driver(box: Sandbox) -> AsyncIterator[tuple[Driver, CSIClient]]:
    async with in_process_driver(box) as pair:
        yield pair


def direct_read(device: FakeNVMe, offset: int, length: int) -> bytes:
    """Bytes as on the device (O_DIRECT, past the host's page cache, which QSD's writes also bypass)."""
    whole = -(-length // 4096) * 4096
    return subprocess.run(["dd", f"if={device.node}", "iflag=direct,skip_bytes,count_bytes", f"skip={offset}",
                           f"count={whole}", "bs=64k", "status=none"], check=True, capture_output=True).stdout[:length]


def direct_write(device: FakeNVMe, offset: int, data: bytes) -> None:
    subprocess.run(["dd", f"of={device.node}", "oflag=direct,seek_bytes", f"seek={offset}", "bs=64k",
                    "conv=notrunc", "status=none"], input=data, check=True)


async def test_foreign_data_is_read_through_qsd_and_refused(
    box: Sandbox, driver: tuple[Driver, CSIClient], nvme: FakeNVMe,  # noqa: F811
) -> None:
    subprocess.run(["mkfs.ext4", "-q", str(nvme.node)], check=True)
    client = driver[0].daemon.client
    pool = StandInPool(driver[0].catalog, box.state_dir / "pools", nvme)
    await pool.open()
    with pytest.raises(StartupError, match=r"nvme://0000:01:00.0/1 holds data \(.*TYPE=ext4"):
        await pool.attach(client)
    assert not [name for name in await client.exports() if name.startswith("d-")], "the view was left behind"
    forced = StandInPool(driver[0].catalog, box.state_dir / "pools", nvme, force=True)
    await forced.open()
    await forced.attach(client)
    assert direct_read(nvme, 0, len(LABEL_MAGIC)) == LABEL_MAGIC
    assert forced.layout.device_size == DEVICE_BYTES  # from QMP: query-named-block-nodes
    assert forced.usage().available == forced.layout.data_size


async def test_scrub_through_qsd_beside_a_live_window(
    box: Sandbox, driver: tuple[Driver, CSIClient], nvme: FakeNVMe,  # noqa: F811
) -> None:
    client = driver[0].daemon.client
    pool = StandInPool(driver[0].catalog, box.state_dir / "pools", nvme)
    await pool.open()
    await pool.attach(client)
    images = [pool.image_path(f"vol-00000000000000000000000{i}", ImageFormat.RAW) for i in (1, 2)]
    for image in images:
        await pool.create(image, 64 * MIB, VM)
    starts = [pool.storage(image).offset for image in images]
    for start in starts:
        direct_write(nvme, start, PATTERN)
    live = graph.nodes_for("vol-000000000000000000000002")
    await client.blockdev_add(pool.storage(images[1]).protocol_blockdev(live, VM, read_only=False))
    try:
        await pool.delete(images[0])
        assert direct_read(nvme, starts[0], len(PATTERN)) == bytes(len(PATTERN))
        assert direct_read(nvme, starts[1], len(PATTERN)) == PATTERN
        assert pool.usage().available == pool.layout.data_size - 64 * MIB
    finally:
        await client.blockdev_del(live.file)
    # Reopened, the pool knows its label (read through QSD again) and keeps its extents; one whose volume
    # the catalog does not know (never created here: these extents were taken by hand) is scrubbed.
    again = StandInPool(driver[0].catalog, box.state_dir / "pools", nvme)
    await again.open()
    await again.attach(client)
    assert again.layout == pool.layout
    assert again.extent_of("vol-000000000000000000000002") is None
    assert direct_read(nvme, starts[1], len(PATTERN)) == bytes(len(PATTERN))


async def test_vm_volume_lifecycle_and_a_qsd_restart(
    box: Sandbox, nvme: FakeNVMe, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """The driver serves the stand-in pool as it would a controller: attach before every rebuild."""
    async def open_stand_in(specs: object, catalog: Catalog, state_dir: Path, failpoints: object,
                            remote: object = ()) -> list[StandInPool]:
        pool = StandInPool(catalog, state_dir / "pools", nvme)
        await pool.open()
        return [pool]

    monkeypatch.setattr(server, "open_device_pools", open_stand_in)
    async with in_process_driver(box) as (driver, csi):
        pool = driver.pools["fast"]
        assert isinstance(pool, StandInPool)
        total, largest = await capacity(csi, "fast")
        assert total == largest == pool.layout.data_size
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await csi.create_volume("pvc-fs", 64 * MIB, {"pool": "fast"})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vhost-user-blk" in (err.value.details() or "")
        vm = await csi.create_volume("pvc-vm", 64 * MIB, {"pool": "fast", "export": "vhost-user-blk"})
        extent = pool.extent_of(vm.volume_id)
        assert extent is not None and (await capacity(csi, "fast"))[0] == total - 64 * MIB
        staging, target = box.staging("vm"), box.target("vm")
        await csi.stage(vm.volume_id, str(staging))
        assert await csi.expand(vm.volume_id, str(staging), 128 * MIB) == 128 * MIB  # in place, before publishing
        await csi.publish(vm.volume_id, str(staging), str(target))
        client = driver.daemon.client
        nodes = graph.nodes_for(vm.volume_id)
        assert (await client.named_nodes())[nodes.file]["virtual_size"] == 128 * MIB

        old = qsd_pid(box)
        assert old is not None
        os.kill(old, signal.SIGKILL)
        await wait_new_qsd(box, old)
        await until(lambda: driver.daemon.ready, "the new QSD rebuilt", 60)
        assert await export_nodes.has_export(client, nodes.vhost_export)
        assert pool.base.node_name in await client.node_names()  # attached again before the rebuild
        assert (target / "vhost-user-blk.sock").is_socket()

        # A second VM volume's window shares the node beside the first's live export.
        other = await csi.create_volume("pvc-vm2", 32 * MIB, {"pool": "fast", "export": "vhost-user-blk"})
        ostaging, otarget = box.staging("vm2"), box.target("vm2")
        await csi.stage(other.volume_id, str(ostaging))
        await csi.publish(other.volume_id, str(ostaging), str(otarget))
        assert (otarget / "vhost-user-blk.sock").is_socket()

        direct_write(nvme, extent.start, PATTERN)  # what the VM would have written
        await csi.unpublish(vm.volume_id, str(target))
        await csi.unstage(vm.volume_id, str(staging))
        await csi.delete_volume(vm.volume_id)
        await driver.volumes.freed()  # DeleteVolume answered; the extent is scrubbed right after
        assert direct_read(nvme, extent.start, len(PATTERN)) == bytes(len(PATTERN))  # scrubbed through QSD
        assert (await capacity(csi, "fast"))[0] == total - 32 * MIB
        await csi.unpublish(other.volume_id, str(otarget))
        await csi.unstage(other.volume_id, str(ostaging))
        await csi.delete_volume(other.volume_id)
        await driver.volumes.freed()
        assert (await capacity(csi, "fast"))[0] == total
