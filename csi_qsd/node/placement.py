"""Which of the node's QSD shards serves a volume when it is first staged.

Volumes that may have to change at one instant share a shard: one QMP
transaction cuts a group snapshot, and it reaches into one QSD only. A
claim's namespace is the key where the provisioner passes it (a
VolumeGroupSnapshot selects claims of one namespace); otherwise the root of
the volume's lineage (the volume its clones and restores came from), so a
chain's images are opened by one QSD. Device pools are opened by shard 0
alone (one process owns a device), so their volumes stay there. The choice
is recorded in the stage row and kept until unstage.
"""

from __future__ import annotations

from csi_qsd.catalog import Catalog, VolumeRecord
from csi_qsd.params import DEFAULT_POOL_NAME
from csi_qsd.qsd.shards import place

# A lineage deeper than this is cut short (the key is still stable: the same volume gives the same walk).
MAX_LINEAGE = 64


async def shard_for(catalog: Catalog, volume: VolumeRecord, count: int) -> int:
    if count == 1 or volume.pool != DEFAULT_POOL_NAME:
        return 0
    return place(await placement_key(catalog, volume), count)


async def placement_key(catalog: Catalog, volume: VolumeRecord) -> str:
    """The claim's namespace, else the lineage root's volume ID."""
    if volume.params.namespace:
        return f"namespace:{volume.params.namespace}"
    root, seen = volume.id, {volume.id}
    source = volume.source
    while source and len(seen) < MAX_LINEAGE:
        kind, _, ident = source.partition(":")
        if kind == "snapshot":
            snapshot = await catalog.snapshot(ident)
            ident = snapshot.source_volume_id if snapshot is not None else ""
        if not ident or ident in seen:
            break
        seen.add(ident)
        root = ident
        parent = await catalog.volume(ident)
        source = parent.source if parent is not None else ""
    return f"volume:{root}"
