"""The pool interface: where a volume's bytes live and how QSD opens them.

A pool hands out storage references (an image path in the file pool; a
device pool's names an extent), creates, grows, layers and deletes what they
name, reports capacity, and names what QSD opens for a reference
(`csi_qsd.qsd.storage`). The domain never looks inside a reference. Pools
never change the graph of a volume. A device pool touches the catalog only
for its own rows of the `extents` table, which are its allocation state, and
a moved volume's image generation, in the transaction that commits the move;
`settle_image` only to record that a volume's image is now durable. A pool
whose device only QSD can reach (the userspace NVMe way in) reads and zeroes
it through QSD once `attach` has handed it the client.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import NamedTuple

from csi_qsd.catalog import Catalog, VolumeRecord
from csi_qsd.errors import FailedPrecondition
from csi_qsd.params import ImageFormat, VolumeParameters
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.storage import Storage
from csi_qsd.sys.volume_keys import VolumeKey


@dataclasses.dataclass(frozen=True)
class PoolUsage:
    total: int
    available: int


class NewImage(NamedTuple):
    """A blank image a CreateVolume answered for before it was written: what `Pool.settle` writes."""

    path: Path
    size: int
    params: VolumeParameters

    @classmethod
    def of(cls, volume: VolumeRecord) -> NewImage:
        """What `Pool.settle` writes for `volume`."""
        return cls(volume.image, volume.capacity, volume.params)


class Pool(abc.ABC):
    """One place volumes live; `id` is what the catalog records on every volume."""

    id: str

    @abc.abstractmethod
    def prepare(self) -> None:
        """Make the pool usable (directories, device checks); safe to repeat."""

    async def attach(self, client: QSDClient) -> None:
        """Open in QSD what the pool's volumes stand on, before each graph rebuild; idempotent.

        The default (files, host block devices) needs nothing: each volume
        opens its own file or device. Raises StartupError if QSD cannot.
        """

    @abc.abstractmethod
    def usage(self) -> PoolUsage:
        """The pool's size and free bytes now; cheap enough for the event loop. Raises OSError."""

    @abc.abstractmethod
    async def allocated(self, images: list[Path]) -> dict[Path, int]:
        """Bytes each of `images` occupies in the pool now; a reference that names nothing here is left out.

        For metrics: what a volume really takes, beside the capacity it was
        given. Raises OSError when the pool cannot be read.
        """

    @abc.abstractmethod
    def image_path(self, volume_id: str, fmt: ImageFormat, generation: int = 0) -> Path:
        """The storage reference of a volume's image of `generation` (0: as created, later: overlays)."""

    @abc.abstractmethod
    async def create(self, image: Path, size: int, params: VolumeParameters, *, key: VolumeKey | None = None) -> None:
        """Raises ResourceExhausted when the pool cannot hold `size` bytes."""

    def settles_later(self, params: VolumeParameters) -> bool:
        """Whether CreateVolume may answer for a volume of `params` before its image exists (default: never).

        Such a volume holds no data until it is staged, so its image need not
        be on the disk when the CO learns of it: `check_room` is asked before
        its row commits and `settle` writes the image afterwards, in batches,
        and before the volume is staged or snapshotted.
        """
        return False

    async def check_room(self, size: int) -> None:
        """Raises ResourceExhausted when the pool cannot hold an image of `size` bytes now (`settles_later`)."""
        raise NotImplementedError(f"pool {self.id} makes every image durably (`create`)")

    async def settle(self, images: list[NewImage]) -> list[Path]:
        """Write the blank images not written yet and make all of them durable; idempotent.

        Returns the images now durable. Raises ResourceExhausted when the pool
        has no room left to write one. The default has nothing to write.
        """
        return [image.path for image in images]

    async def grow(self, image: Path, size: int) -> bool:
        """Make room where `image` lives for it to hold `size` bytes, before QSD grows it; idempotent.

        True when the room is there: the default (the file pool) always, as
        an image file grows inside QSD (block_resize). False when only a move
        to a new home would give it (`reserve_move`). Raises OutOfRange when
        the room cannot be had at all.
        """
        return True

    async def reserve_move(self, image: Path, size: int) -> Storage:
        """Take a new home with room for `size` bytes for the volume of `image`, not yet its own; idempotent.

        What it returns is how QSD opens the new home for the copy: at the
        size the volume has now, so it can mirror the old one. A crash
        before `commit_move` leaves a move that `end_move` undoes. Raises
        OutOfRange when no home is large enough.
        """
        raise FailedPrecondition(f"pool {self.id} does not move volumes")

    async def commit_move(self, image: Path, generation: int) -> None:
        """The new home holds every acknowledged write: make it the volume's, with image generation `generation`.

        The old home is kept (QSD may still read it) until `end_move`.
        """
        raise FailedPrecondition(f"pool {self.id} does not move volumes")

    async def end_move(self, image: Path, *, committed: bool) -> None:
        """Free the home QSD no longer uses: the old one after a commit, else the new one; idempotent."""

    def moves_under_way(self) -> dict[str, bool]:
        """The volumes a crash left mid-move, each with whether its move committed (none by default)."""
        return {}

    @abc.abstractmethod
    async def create_overlay(
        self, image: Path, backing: Path, size: int, granularity: int, *, key: VolumeKey | None = None,
    ) -> None:
        """A thin qcow2 over `backing`, O(1): snapshots, restores and clones.

        `granularity` is the volume's changed-block granularity: the overlay
        allocates in units of it (`csi_qsd.qcow2.granularity`), as every image of
        the volume's chain does.
        """

    async def create_encrypted_copy(self, image: Path, size: int, granularity: int, key: VolumeKey,
                                    backing_name: str) -> None:
        """An encrypted qcow2 `image` over another node's image (`backing_name`, a `json:` link), not opened.

        Only a file pool holds encrypted images: raises FailedPrecondition elsewhere.
        """
        raise FailedPrecondition(f"pool {self.id!r} holds no encrypted images")

    async def opens_with(self, image: Path, key: VolumeKey) -> bool:
        """Whether `key` unlocks the encrypted image `image` (only a file pool holds encrypted images)."""
        return False

    async def add_key(self, image: Path, opened_by: VolumeKey, key: VolumeKey, *, in_use: bool) -> None:
        """Give the encrypted image `image` a keyslot for `key` (it opens with `opened_by`); `in_use`: QSD holds it
        read-only. Raises FailedPrecondition (no pool but a file pool holds encrypted images), HostCommandError."""
        raise FailedPrecondition(f"pool {self.id} holds no encrypted images")

    async def remove_key(self, image: Path, opened_by: VolumeKey, key: VolumeKey, *, in_use: bool) -> None:
        """Erase every keyslot of `image` that `key` opens (`opened_by` opens another). Raises as `add_key`."""
        raise FailedPrecondition(f"pool {self.id} holds no encrypted images")

    @abc.abstractmethod
    async def backing_of(self, image: Path) -> str: ...

    @abc.abstractmethod
    async def flatten(self, image: Path) -> None:
        """Copy the whole backing chain into `image` and drop its backing, offline."""

    @abc.abstractmethod
    async def delete(self, image: Path) -> None: ...

    async def delete_all(self, images: list[Path]) -> None:
        """Delete every one of `images`, durably once this returns, as `delete` does; in order, stopping at the
        first failure (what was deleted stays deleted). A pool may share the cost of making them durable."""
        for image in images:
            await self.delete(image)

    @abc.abstractmethod
    def leftovers(self) -> list[Path]:
        """What a crash left half-made (never user data): the start-up reconcile removes it."""

    @abc.abstractmethod
    def images(self) -> list[Path]: ...

    @abc.abstractmethod
    def storage(self, image: Path) -> Storage:
        """What QSD opens for the storage reference `image`."""

    async def check(self, image: Path, *, in_use: bool) -> str:
        """Why what `image` names cannot serve its volume ('' if nothing is known to be wrong).

        For the controller's volume condition. `in_use`: QSD has it open and
        writing, so only checks its cached metadata cannot fool. The cost must
        stay bounded (a pool caches what it learnt). The default knows nothing.
        """
        return ""

    def holds_no_data(self, image: Path) -> bool:
        """True when `image` itself holds no byte of data (whatever it reads through): safe to drop unnamed.

        Cheap (reads metadata only), and False whenever unsure, which the default always is.
        """
        return False

    def reads_as_zeros(self, image: Path) -> bool:
        """True when what `image` names is known to read as zeros (never written): no filesystem to probe for.

        Cheap (reads metadata only), and False whenever unsure, which the default always is.
        """
        return False

    def check_parameters(self, params: VolumeParameters) -> None:
        """Refuse StorageClass parameters this pool cannot serve. Raises InvalidArgument."""

    def largest_volume(self) -> int:
        """The largest volume that can be created now (GetCapacity's maximum_volume_size)."""
        return self.usage().available


async def settle_image(catalog: Catalog, pool: Pool, volume: VolumeRecord) -> None:
    """Write and make durable `volume`'s image if CreateVolume answered before it was; idempotent.

    Called before the volume may hold data (a stage) or back another image
    (a snapshot); harmless beside the settling CreateVolume started. Once the
    image is durable, the catalog records it so (`image_pending` cleared).
    """
    if volume.image_pending and await pool.settle([NewImage.of(volume)]):
        await catalog.set_images_settled([volume.id])
