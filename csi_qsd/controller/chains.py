"""Backing chains: reclaim images nobody needs any more, and measure chain depth.

A snapshot the user deleted while volumes or newer snapshots still stood on it
stays hidden; it goes when its last dependant goes. A lease that serves an
image to a copy on another node counts as a dependant (`Catalog.dependants`),
so no flatten or reclaim deletes what a copy still reads. Reclaiming walks down the
chain, so one delete can free several hidden layers. Only hidden snapshots'
images are ever removed here.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from csi_qsd.catalog import Catalog, SnapshotState, VolumeRecord
from csi_qsd.pools.base import Pool

log = logging.getLogger(__name__)

MAX_CHAIN = 4096  # a longer chain in the catalog is a loop, not a chain


async def reclaim(catalog: Catalog, pool: Pool, image: str) -> None:
    """Delete `image` if it belongs to a hidden snapshot with no dependants, then its backing, and so on."""
    while image:
        snapshot = await catalog.snapshot_by_image(image)
        if snapshot is None or not snapshot.hidden or await catalog.dependants(image) > 0:
            return
        log.info("event=reclaim snapshot_id=%s image=%s", snapshot.id, image)
        await catalog.put_snapshots([dataclasses.replace(snapshot, state=SnapshotState.DELETING)])
        await pool.delete(Path(image))
        await catalog.delete_snapshot(snapshot.id)
        image = snapshot.backing


async def from_backing(catalog: Catalog, backing: str) -> list[Path]:
    """`backing` and the images below it, newest first, as the catalog records them."""
    found: list[Path] = []
    while backing and len(found) < MAX_CHAIN:
        found.append(Path(backing))
        below = await catalog.snapshot_by_image(backing)
        backing = below.backing if below is not None else ""
    return found


async def images_below(catalog: Catalog, image: str) -> list[Path]:
    """The images `image` reads through, newest first (itself not included)."""
    snapshot = await catalog.snapshot_by_image(image)
    return await from_backing(catalog, snapshot.backing) if snapshot is not None else []


async def depth(catalog: Catalog, volume: VolumeRecord) -> int:
    """How many images a volume reads through: 1 for a volume with no backing."""
    return 1 + len(await from_backing(catalog, volume.backing))
