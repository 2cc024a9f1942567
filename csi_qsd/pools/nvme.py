"""The userspace NVMe way into a device pool: QSD's own `nvme` driver over VFIO.

`--device-pool NAME=nvme://0000:01:00.0[/NAMESPACE][,force]` names a PCI
NVMe controller bound to `vfio-pci` and one of its namespaces (default 1).
The host has no block device for it, so everything the host-block way in
reads from the kernel comes from QSD instead (`csi_qsd.qsd.device_io`):
the capacity from `query-named-block-nodes`, the label and foreign-data
signatures from the start of the namespace read through a read-only FUSE
export, and scrubs as write-zeroes issued by QSD. This module holds the
address and what udev (pyudev) says of the PCI function: present, and
bound to `vfio-pci`; nothing here touches the device.

What must never happen: a pool that opens another device than the one
named (the address is validated strictly and must stay bound to vfio-pci),
or a foreign namespace taken without `force` (its start is probed through
QSD, as `blkid -p` probes a block device).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pyudev

from csi_qsd.errors import InvalidArgument
from csi_qsd.params import ExportKind, VolumeParameters
from csi_qsd.pool_specs.nvme_address import NvmeAddress
from csi_qsd.pools.device import DevicePool
from csi_qsd.pools.through_qsd import DevicePoolThroughQSD
from csi_qsd.qsd.storage import NvmeNamespace
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints

if TYPE_CHECKING:
    from csi_qsd.catalog import Catalog
    from csi_qsd.pool_specs.device_spec import DevicePoolSpec

VFIO_DRIVER = "vfio-pci"


def vfio_problem(address: NvmeAddress, dev: Path = Path("/dev")) -> str:
    """Why QSD cannot drive the controller now ('' if it can), from udev and sysfs alone (no device I/O).

    Used at start-up (a clear error before QSD tries) and by the volume
    check, so a controller that vanished or was rebound to the kernel's
    nvme driver reports the pool's volumes abnormal rather than hanging.
    """
    try:
        device = pyudev.Devices.from_name(pyudev.Context(), "pci", address.pci)
    except pyudev.DeviceNotFoundError:
        return f"PCI device {address.pci} is not present"
    if device.driver != VFIO_DRIVER:
        bound = device.driver or "no driver"
        return (f"PCI device {address.pci} is bound to {bound}, not {VFIO_DRIVER} "
                f"(bind it: driverctl set-override {address.pci} {VFIO_DRIVER})")
    group = Path(device.sys_path) / "iommu_group"
    if not group.exists():
        return f"PCI device {address.pci} has no IOMMU group: turn the IOMMU on (intel_iommu=on or amd_iommu=on)"
    node = dev / "vfio" / group.resolve().name
    if not node.exists():
        return f"{node} (the VFIO group of {address.pci}) is missing: is it mounted into the plugin's container?"
    return ""


def base_node_name(pool: str) -> str:
    """The QSD node of a pool's whole namespace, shared by its volumes' windows (QEMU allows 31 characters)."""
    return f"d-{pool}"


class NvmeDevicePool(DevicePoolThroughQSD):
    """A device pool whose device QSD drives itself over VFIO (see `DevicePoolThroughQSD` for the two steps)."""

    def __init__(self, spec: DevicePoolSpec, catalog: Catalog, view_dir: Path,
                 failpoints: Failpoints = NO_FAILPOINTS) -> None:
        if spec.nvme is None:
            raise ValueError(f"device pool {spec.name} names no NVMe address")
        super().__init__(spec, catalog, view_dir,
                         NvmeNamespace(spec.nvme.pci, spec.nvme.namespace, base_node_name(spec.name)), failpoints)
        self.address = spec.nvme

    @property
    def namespace(self) -> NvmeNamespace:
        assert isinstance(self.base, NvmeNamespace)
        return self.base

    def check_parameters(self, params: VolumeParameters) -> None:
        super().check_parameters(params)
        if params.export is not ExportKind.VHOST_USER_BLK:
            raise InvalidArgument(
                f"pool {self.id!r} is driven by qemu-storage-daemon's userspace NVMe driver: its volumes are VM "
                "disks (export 'vhost-user-blk'); filesystem and block volumes need a FUSE export, which on "
                "one shared NVMe node conflicts with every other volume's (QEMU's resize permission)"
            )

    def describe(self) -> str:
        return str(self.address)

    def device_problem(self) -> str:
        return vfio_problem(self.address)

    def same_device(self, other: DevicePool) -> bool:
        return isinstance(other, NvmeDevicePool) and other.address.pci == self.address.pci
