"""Changed-block tracking: allocated and changed extents of snapshots, from their qcow2 chains.

A snapshot freezes its volume's top image and the volume moves on to a new
overlay, so every write made after snapshot B and before snapshot T landed in
one of the images of T's chain that are newer than B's image. The clusters
those images hold (data or zero clusters: a discard in an overlay writes a
zero cluster) are therefore exactly what changed between B and T, at the
volume's granularity (its qcow2 cluster or subcluster, `csi_qsd.qcow2.granularity`;
64 KiB by default), and survive a crash of QSD or the driver: no bitmap
has to have been flushed, the images are the record.

Where a flatten merged the layers below a snapshot's image into it, B's
image is no longer a layer of T's chain; the merged image then holds the
records of the layers merged into it as persistent bitmaps
(`csi_qsd.qcow2.layer_bitmaps`), and the answer is the allocation of T's layers
above the merged image plus the records of the merged layers newer than B:
exact again. Where a record is missing or was lost to a crash, the answer
falls back to everything allocated in T's chain or in B's chain: a superset
(an offset allocated in neither reads as zeros in both), never less. Each
fallback is logged (`event=cbt_fallback` with the reason) and counted
(`fallbacks`, exported as a Prometheus counter).

An encrypted volume's images are read the same way, without its key: the
qcow2 tables and bitmaps are not encrypted, and they are in the volume's
(guest) offsets, so its changed blocks are exact too.

Snapshots of one volume are compared only with each other; the catalog's
`backing` column is the chain. No gRPC types and no QMP here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from csi_qsd import validate
from csi_qsd.catalog import Catalog, SnapshotRecord, SnapshotState
from csi_qsd.controller import chains
from csi_qsd.errors import HostCommandError, InvalidArgument, NotFound, OutOfRange
from csi_qsd.qcow2 import extents, image_bitmaps, imagemap, keyed, layer_bitmaps
from csi_qsd.qcow2.extents import Extent
from csi_qsd.sys.tools import bundled

log = logging.getLogger(__name__)
T = TypeVar("T")

PARALLEL_MAPS = 4


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """An answer: ranges at or after the requested offset, within `capacity`."""

    capacity: int
    extents: list[Extent]
    exact: bool  # False: a superset, because the chain between base and target was merged


class ChangedBlocks:
    """Answers GetMetadataAllocated and GetMetadataDelta from the catalog and the image files."""

    def __init__(self, catalog: Catalog, qemu_img: str, qemu_nbd: str = "") -> None:
        self._catalog = catalog
        self._qemu_img = qemu_img
        self._qemu_nbd = qemu_nbd or bundled("qemu-nbd")
        self.fallbacks = 0  # deltas answered with a superset; read by metrics

    async def allocated(self, snapshot_id: str, starting_offset: int) -> BlockMap:
        """Every range allocated in the snapshot's chain, from `starting_offset` on.

        Raises NotFound, OutOfRange, HostCommandError.
        """
        start = time.monotonic()
        snapshot = await self._visible(snapshot_id, "snapshot_id")
        _check_offset(starting_offset, snapshot.size)
        found = await self._reading([snapshot], self._chain_allocation(snapshot))
        answer = extents.clip(found, starting_offset, snapshot.size)
        log.info("event=cbt_allocated snapshot_id=%s extents=%d bytes=%d seconds=%.3f",
                 snapshot.id, len(answer), extents.total(answer), time.monotonic() - start)
        return BlockMap(snapshot.size, answer, exact=True)

    async def delta(self, base_id: str, target_id: str, starting_offset: int) -> BlockMap:
        """The ranges that changed from snapshot `base_id` to the newer `target_id` of the same volume.

        Raises NotFound, InvalidArgument (other volume, same or newer base),
        OutOfRange, HostCommandError.
        """
        start = time.monotonic()
        base = await self._visible(base_id, "base_snapshot_id")
        target = await self._visible(target_id, "target_snapshot_id")
        if base.source_volume_id != target.source_volume_id:
            raise InvalidArgument(
                f"base snapshot {base.id} is of volume {base.source_volume_id}, target snapshot {target.id} "
                f"of volume {target.source_volume_id}: deltas are between snapshots of one volume"
            )
        if base.id == target.id or base.created_at >= target.created_at:
            raise InvalidArgument(f"base snapshot {base.id} must be older than target snapshot {target.id}")
        _check_offset(starting_offset, target.size)
        chain = await self._chain(target)
        reason = ""
        if base.image in chain[1:]:
            layers = chain[:chain.index(base.image)]
            found = await self._reading([base, target], self._layers(layers))
            exact = True
        else:
            merged, reason = await self._reading([base, target], self._across_merge(base, chain))
            found, exact = merged or [], merged is not None
        if not exact:
            self.fallbacks += 1
            log.warning(
                "event=cbt_fallback base=%s target=%s reason=%r", base.id, target.id,
                f"{reason}; answering with everything allocated in either snapshot",
            )
            both = await self._reading([base, target], asyncio.gather(
                self._chain_allocation(target), self._chain_allocation(base)))
            found = extents.union(*both)
            exact = False
        answer = extents.clip(found, starting_offset, target.size)
        log.info("event=cbt_delta base=%s target=%s exact=%s layers=%d extents=%d bytes=%d seconds=%.3f",
                 base.id, target.id, exact, len(chain), len(answer), extents.total(answer),
                 time.monotonic() - start)
        return BlockMap(target.size, answer, exact)

    # ------------------------------------------------------------------

    async def _visible(self, snapshot_id: str, field: str) -> SnapshotRecord:
        validate.snapshot_id(snapshot_id, field)
        snapshot = await self._catalog.snapshot(snapshot_id)
        if snapshot is None or snapshot.hidden or snapshot.state is not SnapshotState.READY:
            raise NotFound(f"snapshot {snapshot_id} does not exist")
        return snapshot

    async def _chain(self, snapshot: SnapshotRecord) -> list[Path]:
        """The images a snapshot reads through, newest first, as the catalog records them."""
        return [snapshot.image, *await chains.from_backing(self._catalog, snapshot.backing)]

    async def _across_merge(self, base: SnapshotRecord, chain: list[Path]) -> tuple[list[Extent] | None, str]:
        """What changed after `base` where its image was merged into the bottom of `chain`; None and why if unknown."""
        bottom = chain[-1]
        records = image_bitmaps.bitmaps_of((await image_bitmaps.chain_info(self._qemu_img, bottom))[0])
        needed = layer_bitmaps.needed_for(base.image.name, records)
        if needed is None:
            return None, "the base's image is no longer a layer of the target's chain and no merged image records it"
        if needed.lost:
            return None, needed.lost
        above, merged = await asyncio.gather(
            self._layers(chain[:-1]),
            image_bitmaps.read(self._qemu_img, self._qemu_nbd, bottom, needed.names),
        )
        return extents.union(above, *merged), ""

    async def _chain_allocation(self, snapshot: SnapshotRecord) -> list[Extent]:
        """Everything allocated in the snapshot's chain. An encrypted chain's is the union of its layers' tables,
        which are not encrypted: `qemu-img map` of the chain would need the key to open it."""
        try:
            encrypted = await asyncio.to_thread(keyed.encrypted, snapshot.image)
        except OSError as exc:
            raise HostCommandError(f"cannot read the header of {snapshot.image}: {exc.strerror}") from exc
        if encrypted:
            return await self._layers(await self._chain(snapshot))
        return await imagemap.chain_allocation(self._qemu_img, snapshot.image)

    async def _layers(self, layers: list[Path]) -> list[Extent]:
        limit = asyncio.Semaphore(PARALLEL_MAPS)

        async def one(image: Path) -> list[Extent]:
            async with limit:
                return await imagemap.layer_allocation(self._qemu_img, image)

        return extents.union(*await asyncio.gather(*(one(image) for image in layers)))

    async def _reading(self, snapshots: list[SnapshotRecord], work: Awaitable[T]) -> T:
        """Await a read of image files; one that fails because a snapshot went meanwhile is NotFound."""
        try:
            return await work
        except HostCommandError:
            for snapshot in snapshots:
                await self._visible(snapshot.id, "snapshot_id")
            raise


def _check_offset(starting_offset: int, capacity: int) -> None:
    if starting_offset < 0 or starting_offset > capacity:
        raise OutOfRange(f"starting_offset {starting_offset} is outside the snapshot (0 to {capacity} bytes)")
