"""Moving a staged volume to a new home in its pool while it stays in use.

This is how a device pool's volume grows when the space after its extent is
taken: it moves to a free extent large enough, then grows there in place.
The steps, each of which a crash may cut off:

1. the pool takes the new home (MOVING: kept from everyone, scrubbed if the
   move is undone);
2. the volume's export kind copies the volume there under its live export,
   switches the export to it and commits (`ExportPath.move`): the pool makes
   the new home the volume's, at the next image generation, and the old one
   RETIRING. Until the commit, QSD reads the old home or both hold every
   acknowledged write; from it on, the new one holds them all;
3. the old top is closed in QSD and the pool scrubs the old home.

`settle` finishes a committed move and undoes any other; the restart calls
it for every move a crash left, before anything else touches the volume.
"""

from __future__ import annotations

import dataclasses
import logging

from csi_qsd.catalog import PublishRecord, StageRecord, VolumeRecord
from csi_qsd.exports.base import ExportHost, ExportPath
from csi_qsd.qsd import move as qsd_move
from csi_qsd.qsd.attach import TopImage

log = logging.getLogger(__name__)


async def move(
    host: ExportHost, kind: ExportPath, volume: VolumeRecord, stage: StageRecord,
    publishes: list[PublishRecord], size: int,
) -> VolumeRecord:
    """Move `volume` to a home of its pool with room for `size` bytes; return it as it now is.

    Raises what `check_move` and the pool raise before anything changes,
    and Aborted, QSDError or Unavailable if the move failed (then undone, or
    finished if it had committed, as far as QSD lets it).
    """
    pool = host.pools[volume.pool]
    kind.check_move(volume, stage, publishes)
    storage = await pool.reserve_move(volume.image, size)
    old = host.top_image(volume)
    new = dataclasses.replace(old, generation=volume.generation + 1, storage=storage)
    committed = False

    async def commit() -> None:
        nonlocal committed
        await pool.commit_move(volume.image, new.generation)
        committed = True

    log.info("event=move_start volume_id=%s pool=%s generation=%d", volume.id, volume.pool, new.generation)
    try:
        await kind.move(volume, stage, old, new, commit)
    except Exception:
        log.exception("event=move_failed volume_id=%s committed=%s", volume.id, committed)
        moved = dataclasses.replace(volume, generation=new.generation) if committed else volume
        try:
            await settle(host, kind, moved, stage, old, new, committed=committed)
        except Exception:
            log.exception("event=move_settle_failed volume_id=%s (the next start settles it)", volume.id)
        raise
    moved = dataclasses.replace(volume, generation=new.generation)
    await settle(host, kind, moved, stage, old, new, committed=True)
    log.info("event=moved volume_id=%s pool=%s generation=%d", volume.id, volume.pool, new.generation)
    return moved


def tops_of(host: ExportHost, volume: VolumeRecord, *, committed: bool) -> tuple[TopImage, TopImage]:
    """The old and new tops of the move a crash left on `volume` (the catalog's generation moves at the commit)."""
    current = host.top_image(volume)
    if committed:
        return dataclasses.replace(current, generation=volume.generation - 1), current
    return current, dataclasses.replace(current, generation=volume.generation + 1)


async def settle(
    host: ExportHost, kind: ExportPath, volume: VolumeRecord, stage: StageRecord | None,
    old: TopImage, new: TopImage, *, committed: bool,
) -> None:
    """Finish a move that committed (or that QSD already switched), undo any other; idempotent.

    `volume` is the catalog's row. Lets go of any hold on the consumer
    first, so finishing can take a new one.
    """
    pool = host.pools[volume.pool]
    client = host.client_of(volume.id)
    if stage is not None:
        await kind.release(volume, stage)
    live = stage is not None and old.nodes.throttle in await client.node_names()
    if live and not committed and await qsd_move.serves(client, new):
        await pool.commit_move(volume.image, new.generation)  # switched before the crash: the new home is the truth
        volume = dataclasses.replace(volume, generation=new.generation)
        committed = True
    if live and not committed:
        await qsd_move.abandon(client, old, new)
    elif live:
        assert stage is not None
        if not await qsd_move.serves(client, new):
            await kind.finish_move(volume, stage, old, new)
        await qsd_move.drop_old(client, old)
    await pool.end_move(volume.image, committed=committed)
    log.info("event=move_settled volume_id=%s committed=%s graph=%s", volume.id, committed, live)
