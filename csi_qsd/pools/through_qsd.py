"""A device pool whose device only QSD can reach: the NVMe way in (VFIO) and remote targets (iSCSI, NBD).

The host has no block device for it, so everything the host-block way in
reads from the kernel comes from QSD instead (`csi_qsd.qsd.device_io`):
the capacity from `query-named-block-nodes`, the label and foreign-data
signatures from the start of the device read through a read-only FUSE
view of the pool's own node, and scrubs as write-zeroes issued by QSD.
A subclass names that node (`base`: what QSD opens, with the objects it
needs first) and says what is wrong with the device without touching it
(`device_problem`, or `problem` where that means asking over the network).

What must never happen: a foreign device taken without `force` (its start
is probed through QSD, as `blkid -p` probes a block device).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from csi_qsd.errors import QSDError, StartupError
from csi_qsd.pools.block_device import foreign_signatures, read_label, write_label
from csi_qsd.pools.device import DevicePool
from csi_qsd.qsd import device_io
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.storage import NvmeNamespace, RemoteDevice
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints

if TYPE_CHECKING:
    from csi_qsd.catalog import Catalog
    from csi_qsd.pool_specs.device_spec import DevicePoolSpec


class DevicePoolThroughQSD(DevicePool):
    """A device pool opened in two steps, `open` then `attach`.

    `open` runs before QSD does: it checks what can be known without QSD (a
    clear start-up error for a device that is missing or unreachable) and
    loads the pool's extents from the catalog. `attach` runs at the start
    of every graph rebuild (a fresh or adopted QSD): it adds the objects and
    the pool's node if QSD lacks them and, the first time, reads the size
    and label through QSD, refuses foreign data, and finishes scrubs.
    Scrubs asked for before that wait in the catalog (SCRUBBING rows are
    never handed out).
    """

    def __init__(self, spec: DevicePoolSpec, catalog: Catalog, view_dir: Path, base: NvmeNamespace | RemoteDevice,
                 failpoints: Failpoints = NO_FAILPOINTS) -> None:
        super().__init__(spec, catalog, failpoints)
        self.base = base
        self._host = base
        self._view = view_dir / spec.name / "head"
        self._client: QSDClient | None = None

    async def open(self) -> None:
        """Check the device can be handed to QSD, and load the extents; no I/O. Raises StartupError."""
        problem = await self.problem()
        if problem:
            raise StartupError(f"{self.startup_name()}: {problem}")
        self._rows = {row.start: row for row in await self._catalog.extents(self.id)}

    async def attach(self, client: QSDClient) -> None:
        try:
            await self._add_base(client)
        except QSDError as exc:
            raise StartupError(f"{self.startup_name()}: qemu-storage-daemon cannot open it: {exc}") from None
        self._client = client
        if self._layout is None:
            await self._open_device(await device_io.node_size(client, self.base.node_name), 0)
        else:
            await self._scrub_pending()

    async def _add_base(self, client: QSDClient) -> None:
        """The pool's node, added if QSD lacks it. Raises QSDError."""
        if self.base.node_name not in await client.node_names():
            await client.blockdev_add(self.base.base_blockdev())

    def startup_name(self) -> str:
        """The pool as start-up errors name it."""
        return f"device pool {self.id} ({self.describe()})"

    # the device, through QSD ------------------------------------------------

    @property
    def client(self) -> QSDClient:
        if self._client is None:
            raise RuntimeError(f"device pool {self.id} is not attached to qemu-storage-daemon yet")
        return self._client

    async def _read_label(self) -> dict[str, object] | None:
        async with device_io.view(self.client, self.base.node_name, self._view) as head:
            return await asyncio.to_thread(read_label, head)

    async def _foreign_data(self) -> str:
        # No O_EXCL test: no kernel driver holds the device; QSD alone reaches it.
        async with device_io.view(self.client, self.base.node_name, self._view) as head:
            return await foreign_signatures(head)

    async def _zero(self, start: int, length: int) -> None:
        await device_io.zero_range(self.client, self.base.node_name, start, length)

    async def _write_label(self, label: dict[str, object]) -> None:
        # Only when the pool takes the device, before any volume's window exists beside the writable view.
        async with device_io.view(self.client, self.base.node_name, self._view, writable=True) as head:
            await asyncio.to_thread(write_label, head, label)

    async def _scrub_pending(self) -> None:
        if self._client is not None:  # before QSD is up, SCRUBBING rows wait for `attach`
            await super()._scrub_pending()
