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

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import pyudev

from csi_qsd.errors import InvalidArgument, QSDError, StartupError
from csi_qsd.failpoints import NONE as NO_FAILPOINTS, Failpoints
from csi_qsd.params import ExportKind, VolumeParameters
from csi_qsd.pools.nvme_address import NvmeAddress
from csi_qsd.pools.device import DevicePool, foreign_signatures, read_label, write_label
from csi_qsd.qsd import device_io
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.storage import NvmeNamespace

if TYPE_CHECKING:
    from csi_qsd.catalog import Catalog
    from csi_qsd.config import DevicePoolSpec

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


class NvmeDevicePool(DevicePool):
    """A device pool whose device QSD drives itself: opened in two steps, `open` then `attach`.

    `open` runs before QSD does: it checks what udev and sysfs say (a clear
    start-up error for a missing device, a wrong driver, no IOMMU group)
    and loads the pool's extents from the catalog. `attach` runs at the
    start of every graph rebuild (a fresh or adopted QSD): it adds the
    namespace's node if QSD lacks it and, the first time, reads the size
    and label through QSD, refuses foreign data, and finishes scrubs.
    Scrubs asked for before that wait in the catalog (SCRUBBING rows are
    never handed out).
    """

    def __init__(self, spec: DevicePoolSpec, catalog: Catalog, view_dir: Path,
                 failpoints: Failpoints = NO_FAILPOINTS) -> None:
        super().__init__(spec, catalog, failpoints)
        if spec.nvme is None:
            raise ValueError(f"device pool {spec.name} names no NVMe address")
        self.address = spec.nvme
        self.namespace = NvmeNamespace(self.address.pci, self.address.namespace, base_node_name(spec.name))
        self._host = self.namespace
        self._view = view_dir / spec.name / "head"
        self._client: QSDClient | None = None

    async def open(self) -> None:
        """Check the controller can be handed to QSD, and load the extents; no I/O. Raises StartupError."""
        problem = await asyncio.to_thread(self.device_problem)
        if problem:
            raise StartupError(f"device pool {self.id} ({self.address}): {problem}")
        self._rows = {row.start: row for row in await self._catalog.extents(self.id)}

    async def attach(self, client: QSDClient) -> None:
        if self.namespace.node_name not in await client.node_names():
            try:
                await client.blockdev_add(self.namespace.base_blockdev())
            except QSDError as exc:
                raise StartupError(f"device pool {self.id}: qemu-storage-daemon cannot open {self.address}: "
                                   f"{exc}") from None
        self._client = client
        if self._layout is None:
            await self._open_device(await device_io.node_size(client, self.namespace.node_name), 0)
        else:
            await self._scrub_pending()

    def check_parameters(self, params: VolumeParameters) -> None:
        super().check_parameters(params)
        if params.export is not ExportKind.VHOST_USER_BLK:
            raise InvalidArgument(
                f"pool {self.id!r} is driven by qemu-storage-daemon's userspace NVMe driver: its volumes are VM "
                "disks (export 'vhost-user-blk'); filesystem and block volumes need a FUSE export, which on "
                "one shared NVMe node conflicts with every other volume's (QEMU's resize permission)"
            )

    # the device, through QSD ------------------------------------------------

    def describe(self) -> str:
        return str(self.address)

    @property
    def client(self) -> QSDClient:
        if self._client is None:
            raise RuntimeError(f"device pool {self.id} is not attached to qemu-storage-daemon yet")
        return self._client

    async def _read_label(self) -> dict[str, object] | None:
        async with device_io.view(self.client, self.namespace.node_name, self._view) as head:
            return await asyncio.to_thread(read_label, head)

    async def _foreign_data(self) -> str:
        # No O_EXCL test: bound to vfio-pci, no kernel driver can hold it, and QSD's VFIO container is exclusive.
        async with device_io.view(self.client, self.namespace.node_name, self._view) as head:
            return await foreign_signatures(head)

    async def _zero(self, start: int, length: int) -> None:
        await device_io.zero_range(self.client, self.namespace.node_name, start, length)

    async def _write_label(self, label: dict[str, object]) -> None:
        # Only when the pool takes the device, before any volume's window exists beside the writable view.
        async with device_io.view(self.client, self.namespace.node_name, self._view, writable=True) as head:
            await asyncio.to_thread(write_label, head, label)

    async def _scrub_pending(self) -> None:
        if self._client is not None:  # before QSD is up, SCRUBBING rows wait for `attach`
            await super()._scrub_pending()

    def device_problem(self) -> str:
        return vfio_problem(self.address)

    def same_device(self, other: DevicePool) -> bool:
        return isinstance(other, NvmeDevicePool) and other.address.pci == self.address.pci
