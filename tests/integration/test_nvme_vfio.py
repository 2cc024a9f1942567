"""The userspace NVMe way in on a real controller: QSD's `nvme` driver over VFIO.

Needs a PCI NVMe controller bound to vfio-pci (IOMMU on, /dev/vfio present)
whose address is given in CSI_QSD_TEST_NVME_PCI (e.g. 0000:01:00.0, or
0000:01:00.0/2 for namespace 2). Its namespace is taken over: it must be
blank or already labelled for pool `vfio`, or CSI_QSD_TEST_NVME_FORCE=1
must allow csi-qsd to overwrite it. Elsewhere every test here skips with
the reason; tests/integration/test_nvme_through_qsd.py covers the same
code with a loop device standing in for the controller.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli.client import CSIClient, capability
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pools.nvme import NvmeDevicePool, vfio_problem
from csi_qsd.qsd import device_io
from testing import tiers
from testing.harness import Sandbox, in_process_driver

MIB = 1 << 20
ADDRESS = os.environ.get("CSI_QSD_TEST_NVME_PCI", "")
FORCE = os.environ.get("CSI_QSD_TEST_NVME_FORCE") == "1"


def _skip_reason() -> str:
    if not ADDRESS:
        return "no NVMe controller for VFIO: set CSI_QSD_TEST_NVME_PCI to the PCI address of one bound to vfio-pci"
    if not Path("/dev/vfio/vfio").exists():
        return "no /dev/vfio/vfio on this machine: VFIO is not available (IOMMU off, or vfio-pci not loaded)"
    spec = DevicePoolSpec.parse(f"vfio=nvme://{ADDRESS}")
    assert spec.nvme is not None
    return vfio_problem(spec.nvme)


# No install provides a controller: skipped in CI too, and listed at the end of the run.
pytestmark = tiers.needs("integration (NVMe over VFIO)", _skip_reason(), opt_in=True)


def pool_spec() -> tuple[DevicePoolSpec, ...]:
    return (DevicePoolSpec.parse(f"vfio=nvme://{ADDRESS}{',force' if FORCE else ''}"),)


async def test_vm_volume_lifecycle_on_a_vfio_namespace(box: Sandbox) -> None:
    async with in_process_driver(box, device_pools=pool_spec()) as (driver, csi):
        pool = driver.pools["vfio"]
        assert isinstance(pool, NvmeDevicePool)
        size = await device_io.node_size(driver.daemon.client, pool.namespace.node_name)
        assert pool.layout.device_size == size  # capacity from QMP, not from a host block device
        free = await capacity(csi)
        vm = await csi.create_volume("pvc-vm", 64 * MIB, {"pool": "vfio", "export": "vhost-user-blk"})
        assert await capacity(csi) == free - 64 * MIB
        staging, target = box.staging("vm"), box.target("vm")
        await csi.stage(vm.volume_id, str(staging))
        await csi.publish(vm.volume_id, str(staging), str(target))
        assert (target / "vhost-user-blk.sock").is_socket()
        nodes = await driver.daemon.client.named_nodes()
        assert nodes[pool.namespace.node_name]["drv"] == "nvme"
        await csi.unpublish(vm.volume_id, str(target))
        await csi.unstage(vm.volume_id, str(staging))
        await csi.delete_volume(vm.volume_id)
        await driver.volumes.freed()  # scrubbed through QSD before the extent is free
        assert await capacity(csi) == free


async def test_container_volumes_are_refused(box: Sandbox) -> None:
    async with in_process_driver(box, device_pools=pool_spec()) as (_driver, csi):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await csi.create_volume("pvc-fs", 64 * MIB, {"pool": "vfio"})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "vhost-user-blk" in (err.value.details() or "")


async def capacity(csi: CSIClient) -> int:
    response = await csi.controller.GetCapacity(pb.GetCapacityRequest(
        parameters={"pool": "vfio"}, volume_capabilities=[capability()]))
    return int(response.available_capacity)
