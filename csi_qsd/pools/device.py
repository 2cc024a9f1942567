"""A device pool: one whole block device (an NVMe namespace) carved into raw extents, one per volume.

Each volume is a `raw` node with `offset`/`size` over a `host_device` node
of the device, with direct I/O and native AIO
(`csi_qsd.qsd.storage.ExtentOnDevice`): no filesystem and no image format
between a guest and the flash. Where extents lie is recorded in the
catalog's `extents` table; `regions.py` picks them.

What must never happen, and how it is prevented:

* **A device that holds someone's data is taken.** At start-up a device
  without this pool's label is probed (`blkid -p`): a partition table or a
  filesystem refuses the start unless the pool is configured with `force`;
  a device that is mounted or held by another driver (O_EXCL fails) is
  refused always. A device is zeroed before its label is written, so free
  space holds only zeroes; the label lets a restart recognise it.
* **A tenant reads another's bytes.** A deleted volume's extent is marked
  SCRUBBING (committed) before it is zeroed (BLKZEROOUT, `blkdiscard -z`,
  which devices serve as write-zeroes with deallocation) and becomes free
  space only after the zeroing returned. An interrupted scrub is done
  again at start-up; a SCRUBBING extent is never handed out.
* **An extent is lost or given twice.** Choosing and recording happen in
  one catalog transaction; free space is what no row covers, so a crash
  between any two steps leaves either the row (undone by the volume's
  reconcile, which deletes through this pool) or nothing.
* **Growth exposes stale bytes.** A volume grows in place, into the free
  space right after its extent, chosen and recorded in one catalog
  transaction (`grow`), or moves first to a free extent large enough
  (`reserve_move`, `csi_qsd.node.moves`). Free space holds only zeroes (the two
  points above), so the added range needs no scrub before the volume sees it.
* **A move loses or leaks bytes.** The new extent is MOVING (kept from
  everyone, scrubbed if the move is undone) until it holds every
  acknowledged write; then one transaction makes it the volume's and the
  old one RETIRING, which is scrubbed only once QSD has left it.
* **A vanished device hangs the control plane.** `check` looks at udev's
  view (pyudev) and the stable path only, never does I/O on the device.

This module reaches the device as the host's block device. A device only
QSD can reach, the userspace NVMe way in (`nvme.py`) or a remote target
(`remote.py`), is a `DevicePoolThroughQSD` (`through_qsd.py`): it opens in
two steps (`open` before QSD runs, `attach` once it does) and overrides the
methods that touch the device to go through QSD (`_read_label`,
`_foreign_data`, `_zero`, `_write_label`), with `_scrub_pending` waiting
for `attach`. Each kind then names its device (`describe`, `same_device`)
and says what is wrong with it without I/O on it (`device_problem`; a remote
pool overrides `problem` instead, as it asks over the network); the NVMe
pool also refuses volumes other than vhost-user-blk (`check_parameters`),
and a remote pool names its own flag (`configured_as`, `startup_name`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pyudev

from csi_qsd.catalog import Catalog, ExtentChoice, ExtentRecord, ExtentState
from csi_qsd.errors import FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted, StartupError
from csi_qsd.params import ImageFormat, Preallocation, VolumeParameters
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pools import regions
from csi_qsd.pools.base import Pool, PoolUsage
from csi_qsd.pools.block_device import (
    LABEL_VERSION,
    BlockDevice,
    claim_exclusively,
    find_block_device,
    foreign_signatures,
    read_label,
    write_label,
    zero_range,
)
from csi_qsd.pools.regions import Layout, Region
from csi_qsd.qsd.storage import ExtentOnDevice, HostDevice, WholeDevice
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints
from csi_qsd.sys.volume_keys import VolumeKey

log = logging.getLogger(__name__)

REFERENCE_PREFIX = "extent:"


class DevicePool(Pool):
    """Volumes as raw extents of one block device; open with `open()` before use."""

    def __init__(self, spec: DevicePoolSpec, catalog: Catalog, failpoints: Failpoints = NO_FAILPOINTS) -> None:
        self.id = spec.name
        self.spec = spec
        self._catalog = catalog
        self._failpoints = failpoints
        self._device: BlockDevice | None = None
        self._layout: Layout | None = None
        self._rows: dict[int, ExtentRecord] = {}
        self._scrubbing = asyncio.Lock()  # one scrub at a time: blkdiscard opens the device exclusively
        self._host: WholeDevice = HostDevice(path=spec.path)

    # start-up -----------------------------------------------------------

    async def open(self) -> None:
        """Find and check the device, label it on first use, finish interrupted scrubs. Raises StartupError."""
        self._device = await asyncio.to_thread(find_block_device, self.spec.path)
        await self._open_device(self._device.size, self._device.optimal_io_size)

    async def _open_device(self, size: int, optimal_io_size: int) -> None:
        """The checks and bookkeeping of `open` once the device's size is known, whatever the way in."""
        rows = await self._catalog.extents(self.id)
        where = self.describe()
        label = await self._read_label()
        if label is None:
            if rows:
                raise StartupError(
                    f"device pool {self.id}: the catalog records {len(rows)} extents on it, but {where} "
                    "carries no csi-qsd label: is it the right device?"
                )
            label = await self._initialise(size, optimal_io_size)
        elif label.get("pool") != self.id:
            raise StartupError(f"device {where} belongs to device pool {label.get('pool')!r}, not {self.id!r}")
        alignment = label.get("alignment")
        if not isinstance(alignment, int):
            raise StartupError(f"device pool {self.id}: label on {where} has no alignment")
        layout = Layout(size, alignment)
        end = max((row.start + row.length for row in rows), default=0)
        if end > layout.data_end:
            raise StartupError(f"device pool {self.id}: {where} has {size} bytes, extents reach {end}: device shrank?")
        self._layout = layout
        self._rows = {row.start: row for row in rows}
        for row in rows:
            if row.state is not ExtentState.SCRUBBING and await self._catalog.volume(row.volume_id) is None:
                log.warning("event=extent_orphan pool=%s start=%d volume_id=%s action=scrub",
                            self.id, row.start, row.volume_id)
                await self._release(row.volume_id)
        await self._scrub_pending()
        usage = self.usage()
        log.info("event=device_pool_open pool=%s device=%r bytes=%d free=%d alignment=%d volumes=%d",
                 self.id, where, usage.total, usage.available, layout.alignment,
                 sum(r.state is ExtentState.USED for r in self._rows.values()))

    async def _initialise(self, size: int, optimal_io_size: int) -> dict[str, object]:
        """Take a device for this pool: refuse foreign data unless forced, zero it, then label it."""
        where = self.describe()
        found = await self._foreign_data()
        if found and not self.spec.force:
            raise StartupError(
                f"device {where} holds data ({found}); csi-qsd will not overwrite it. "
                f"Wipe it, or configure {self.configured_as()},force"
            )
        layout = Layout(size, regions.alignment_for(optimal_io_size))
        if layout.data_size <= 0:
            raise StartupError(f"device {where} is too small for a device pool ({size} bytes)")
        log.warning("event=device_pool_initialise pool=%s device=%r foreign=%r forced=%s", self.id, where,
                    found, self.spec.force)
        # Zero first, label last: a crash in between leaves an unlabelled device that is initialised again.
        await self._zero(0, layout.data_end)
        label: dict[str, object] = {"version": LABEL_VERSION, "pool": self.id, "alignment": layout.alignment}
        await self._write_label(label)
        return label

    # the device as this way in reaches it: the host's block device (`DevicePoolThroughQSD` overrides these)

    def configured_as(self) -> str:
        """The flag that configures this pool, for messages that tell an admin what to change."""
        return f"--device-pool {self.id}={self.spec.source}"

    def describe(self) -> str:
        """The device for messages: its configured name and what it is now."""
        return f"{self.spec.path} ({self.device.node})"

    async def _read_label(self) -> dict[str, object] | None:
        return await asyncio.to_thread(read_label, self.device.node)

    async def _foreign_data(self) -> str:
        """What the device holds that is not ours ('' if nothing); refuses a device in use always."""
        await asyncio.to_thread(claim_exclusively, self.device.node)
        return await foreign_signatures(self.device.node)

    async def _zero(self, start: int, length: int) -> None:
        await zero_range(self.device.node, start, length)

    async def _write_label(self, label: dict[str, object]) -> None:
        await asyncio.to_thread(write_label, self.device.node, label)

    def same_device(self, other: "DevicePool") -> bool:
        """True if `other` opened the very device this pool did (two pools on one device are refused)."""
        return type(other) is type(self) and other.device.rdev == self.device.rdev

    def prepare(self) -> None:
        """Nothing: `open()` checks the device, as it needs the catalog."""

    # the Pool interface ---------------------------------------------------

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError(f"device pool {self.id} is not open")
        return self._layout

    @property
    def device(self) -> BlockDevice:
        if self._device is None:
            raise RuntimeError(f"device pool {self.id} is not open")
        return self._device

    def _taken(self) -> list[Region]:
        return [Region(r.start, r.length) for r in self._rows.values()]

    def usage(self) -> PoolUsage:
        return PoolUsage(total=self.layout.data_size, available=regions.total_free(self.layout, self._taken()))

    def largest_volume(self) -> int:
        return regions.largest_free(self.layout, self._taken())

    async def allocated(self, images: list[Path]) -> dict[Path, int]:
        """Each volume's extent, which is allocated whole (raw, no format between it and the device); no I/O."""
        found: dict[Path, int] = {}
        for image in images:
            extent = self.extent_of(image.name) if image.parent == self._references else None
            if extent is not None:
                found[image] = extent.length
        return found

    def image_path(self, volume_id: str, fmt: ImageFormat, generation: int = 0) -> Path:
        if generation:
            raise FailedPrecondition(f"device pool {self.id} holds raw extents: volumes on it have no overlays")
        return self._references / volume_id

    def check_parameters(self, params: VolumeParameters) -> None:
        if params.format is not ImageFormat.RAW:
            raise InvalidArgument(
                f"pool {self.id!r} is a device pool: its volumes are raw extents (format 'raw'); "
                "snapshots and clones need format 'qcow2' in the file pool"
            )
        if params.preallocation is not Preallocation.OFF:
            raise InvalidArgument(f"pool {self.id!r} is a device pool: extents are always fully allocated, "
                                  "leave 'preallocation' unset")

    async def create(self, image: Path, size: int, params: VolumeParameters, *, key: VolumeKey | None = None) -> None:
        volume_id = self._volume_of(image)
        record = await self._catalog.take_extent(self.id, volume_id, self._best_fit(size))
        if record is None:
            raise ResourceExhausted(
                f"device pool {self.id} has no free extent of {size} bytes "
                f"(largest free: {self.largest_volume()}, free in all: {self.usage().available})"
            )
        self._rows[record.start] = record
        self._failpoints.hit("extent.after_take")
        log.info("event=extent_taken pool=%s volume_id=%s start=%d length=%d",
                 self.id, volume_id, record.start, record.length)

    async def grow(self, image: Path, size: int) -> bool:
        """Extend the volume's extent in place so it holds `size` bytes; False if only a move can; idempotent.

        Only into the free space right after it: checked and recorded in one
        catalog transaction, so a create running at the same time cannot take
        that space too. The space holds zeroes already (see the module
        docstring). Raises OutOfRange when no free extent anywhere is large
        enough, FailedPrecondition for a volume without an extent here.
        """
        volume_id = self._volume_of(image)
        extent = self._own_extent(volume_id)
        layout = self.layout
        length = regions.align_up(size, layout.alignment)
        if length <= extent.length:
            return True

        def fits(rows: list[ExtentRecord]) -> bool:
            own = [r for r in rows if r.start == extent.start]
            if len(own) != 1 or own[0].volume_id != volume_id or own[0].state is not ExtentState.USED:
                return False
            return regions.grows_in_place(layout, [Region(r.start, r.length) for r in rows], extent, size)

        if not await self._catalog.set_extent_length(self.id, extent.start, length, fits):
            if regions.choose(layout, self._taken(), size) is not None:
                return False
            limit = regions.grow_limit(layout, self._taken(), extent)
            raise OutOfRange(
                f"volume {volume_id} cannot grow to {size} bytes: the space after its extent in device pool "
                f"{self.id} is taken or the device ends (it can grow to {limit} bytes where it is), and no free "
                f"extent of {length} bytes is left to move it to (largest free: {self.largest_volume()})"
            )
        self._rows[extent.start] = dataclasses.replace(self._rows[extent.start], length=length)
        self._failpoints.hit("extent.after_grow")
        log.info("event=extent_grown pool=%s volume_id=%s start=%d length=%d previous=%d",
                 self.id, volume_id, extent.start, length, extent.length)
        return True

    async def reserve_move(self, image: Path, size: int) -> ExtentOnDevice:
        """A MOVING extent of room for `size` bytes, anywhere free; opened at the old extent's length for the copy."""
        volume_id = self._volume_of(image)
        old = self._own_extent(volume_id)
        record = await self._catalog.take_move_extent(self.id, volume_id, self._best_fit(max(size, old.length)))
        if record is None:
            raise OutOfRange(
                f"volume {volume_id} cannot move to a larger extent: device pool {self.id} has no free extent "
                f"of {size} bytes any more (largest free: {self.largest_volume()})"
            )
        self._rows[record.start] = record
        self._failpoints.hit("move.after_reserve")
        log.info("event=extent_move_reserved pool=%s volume_id=%s from=%d to=%d length=%d",
                 self.id, volume_id, old.start, record.start, record.length)
        return ExtentOnDevice(self._host, record.start, old.length)

    async def commit_move(self, image: Path, generation: int) -> None:
        volume_id = self._volume_of(image)
        if not await self._catalog.set_move_committed(self.id, volume_id, generation):
            raise FailedPrecondition(f"device pool {self.id} has no move under way for volume {volume_id}")
        self._rows = {row.start: row for row in await self._catalog.extents(self.id)}
        self._failpoints.hit("move.after_commit")
        log.info("event=extent_move_committed pool=%s volume_id=%s generation=%d", self.id, volume_id, generation)

    async def end_move(self, image: Path, *, committed: bool) -> None:
        """Scrub and free the old extent (`committed`) or the new one (an undone move)."""
        volume_id = self._volume_of(image)
        state = ExtentState.RETIRING if committed else ExtentState.MOVING
        await self._catalog.set_extents_scrubbing(self.id, volume_id, state)
        for start, row in list(self._rows.items()):
            if row.volume_id == volume_id and row.state is state:
                self._rows[start] = dataclasses.replace(row, state=ExtentState.SCRUBBING)
        self._failpoints.hit("move.after_release")
        await self._scrub_pending()

    def moves_under_way(self) -> dict[str, bool]:
        moves: dict[str, bool] = {}
        for row in self._rows.values():
            if row.state in (ExtentState.MOVING, ExtentState.RETIRING):
                moves[row.volume_id] = moves.get(row.volume_id, False) or row.state is ExtentState.RETIRING
        return moves

    async def create_overlay(
        self, image: Path, backing: Path, size: int, granularity: int, *, key: VolumeKey | None = None,
    ) -> None:
        raise FailedPrecondition(f"device pool {self.id} holds raw extents: no snapshots, restores or clones")

    async def backing_of(self, image: Path) -> str:
        return ""

    async def flatten(self, image: Path) -> None:
        raise FailedPrecondition(f"device pool {self.id} holds raw extents: nothing to flatten")

    async def delete(self, image: Path) -> None:
        """Free a volume's extent: mark it SCRUBBING, zero it, then make it free space. Idempotent."""
        await self._release(self._volume_of(image))
        await self._scrub_pending()

    async def _release(self, volume_id: str) -> None:
        await self._catalog.set_extents_scrubbing(self.id, volume_id)
        for start, row in list(self._rows.items()):
            if row.volume_id == volume_id:
                self._rows[start] = dataclasses.replace(row, state=ExtentState.SCRUBBING)
        self._failpoints.hit("extent.after_release")

    async def _scrub_pending(self) -> None:
        """Zero and free every extent released: one scrub at a time, whoever asks (deletes run side by side)."""
        async with self._scrubbing:
            await self._scrub_released()

    async def _scrub_released(self) -> None:
        for row in sorted(self._rows.values(), key=lambda r: r.start):
            if row.state is not ExtentState.SCRUBBING:
                continue
            await self._zero(row.start, row.length)
            self._failpoints.hit("extent.after_scrub")
            await self._catalog.delete_extent(self.id, row.start)
            del self._rows[row.start]
            log.info("event=extent_scrubbed pool=%s volume_id=%s start=%d length=%d",
                     self.id, row.volume_id, row.start, row.length)

    def leftovers(self) -> list[Path]:
        return []

    def images(self) -> list[Path]:
        return sorted(self.image_path(r.volume_id, ImageFormat.RAW)
                      for r in self._rows.values() if r.state is ExtentState.USED)

    def storage(self, image: Path) -> ExtentOnDevice:
        extent = self.extent_of(self._volume_of(image))
        if extent is None:
            raise FailedPrecondition(f"device pool {self.id} has no extent for {image}")
        return ExtentOnDevice(self._host, extent.start, extent.length)

    async def check(self, image: Path, *, in_use: bool) -> str:
        gone = await self.problem()
        if gone:
            return gone
        if self.extent_of(self._volume_of(image)) is None:
            return f"device pool {self.id} records no extent for it"
        return ""

    # helpers ------------------------------------------------------------

    def _best_fit(self, size: int) -> Callable[[list[ExtentRecord]], ExtentChoice | None]:
        """What the catalog calls, under its write lock, to pick a free extent of `size` bytes among its rows."""
        layout = self.layout

        def choose(rows: list[ExtentRecord]) -> ExtentChoice | None:
            picked = regions.choose(layout, [Region(r.start, r.length) for r in rows], size)
            return ExtentChoice(picked.start, picked.length) if picked is not None else None

        return choose

    def _own_extent(self, volume_id: str) -> Region:
        extent = self.extent_of(volume_id)
        if extent is None:
            raise FailedPrecondition(f"device pool {self.id} has no extent for volume {volume_id}")
        return extent

    def extent_of(self, volume_id: str) -> Region | None:
        for row in self._rows.values():
            if row.volume_id == volume_id and row.state is ExtentState.USED:
                return Region(row.start, row.length)
        return None

    async def problem(self) -> str:
        """Why the device is unusable now ('' if nothing is known to be wrong), bounded and without I/O on it."""
        return await asyncio.to_thread(self.device_problem)

    def device_problem(self) -> str:
        """Why the device is unusable now, from udev and the stable path alone (no I/O on the device)."""
        device = self.device
        try:
            st = os.stat(self.spec.path.resolve(strict=True))
        except OSError:
            return f"device {self.spec.path} of pool {self.id} is gone"
        if not stat.S_ISBLK(st.st_mode) or st.st_rdev != device.rdev:
            return f"{self.spec.path} of pool {self.id} now names another device than the one opened"
        try:
            pyudev.Devices.from_device_number(pyudev.Context(), "block", device.rdev)
        except pyudev.DeviceNotFoundError:
            return f"device {device.node} of pool {self.id} was removed"
        return ""

    @property
    def _references(self) -> Path:
        """Where this pool's storage references live: `extent:POOL/VOLUME_ID`."""
        return Path(f"{REFERENCE_PREFIX}{self.id}")

    def _volume_of(self, image: Path) -> str:
        if image.parent != self._references:
            raise FailedPrecondition(f"{image} is not a reference of device pool {self.id}")
        return image.name
