"""Pools without disks: `FakePool` (image files of a few bytes) and `FakeMovingPool` (fixed homes, moves)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from csi_qsd.catalog import Catalog, ExtentChoice, ExtentRecord, ExtentState
from csi_qsd.errors import FailedPrecondition, ResourceExhausted
from csi_qsd.params import ImageFormat, VolumeParameters
from csi_qsd.pools.base import Pool, PoolUsage
from csi_qsd.qsd.graph import QMPArgs
from csi_qsd.qsd.storage import ImageFile
from csi_qsd.sys.volume_keys import VolumeKey


class FakePool(Pool):
    """A pool whose images are small JSON files (size, backing): what a file pool holds, without qemu-img."""

    def __init__(self, directory: Path, pool_id: str = "default", capacity: int = 1 << 40) -> None:
        self.id = pool_id
        self.directory = directory
        self.capacity = capacity

    def prepare(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def usage(self) -> PoolUsage:
        used = sum(self._read(image)["size"] for image in self.images())
        return PoolUsage(total=self.capacity, available=self.capacity - used)

    async def allocated(self, images: list[Path]) -> dict[Path, int]:
        return {image: 0 for image in images if image.exists()}

    def image_path(self, volume_id: str, fmt: ImageFormat, generation: int = 0) -> Path:
        if generation == 0:
            return self.directory / f"{volume_id}.{fmt.value}"
        return self.directory / f"{volume_id}.{generation}.qcow2"

    async def create(self, image: Path, size: int, params: VolumeParameters, *, key: VolumeKey | None = None) -> None:
        if size > self.usage().available:
            raise ResourceExhausted(f"pool {self.id} has {self.usage().available} bytes free")
        self._write(image, size, "")

    async def create_overlay(
        self, image: Path, backing: Path, size: int, granularity: int, *, key: VolumeKey | None = None,
    ) -> None:
        if not backing.exists():
            raise FileNotFoundError(backing)
        self._write(image, size, str(backing))

    async def backing_of(self, image: Path) -> str:
        return str(self._read(image)["backing"])

    async def flatten(self, image: Path) -> None:
        self._write(image, self._read(image)["size"], "")

    async def delete(self, image: Path) -> None:
        image.unlink(missing_ok=True)

    def leftovers(self) -> list[Path]:
        return []

    def images(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if p.suffix in (".qcow2", ".raw"))

    def storage(self, image: Path) -> ImageFile:
        return ImageFile(image)

    def _write(self, image: Path, size: int, backing: str) -> None:
        image.write_text(json.dumps({"size": size, "backing": backing}))

    def _read(self, image: Path) -> dict[str, Any]:
        return dict(json.loads(image.read_text()))


SLOT = 1 << 40  # one home per slot: home n starts at n * SLOT


class FakeMovingPool(FakePool):
    """A pool whose volumes live in fixed homes and grow by moving, as a device pool's do.

    Homes are rows of the catalog's `extents` table, so a move's commit and
    the volume's new image generation are one transaction (`Catalog.set_move_committed`)
    and a restarted driver finds a move a crash cut off by reading them back
    (`load`). `room_in_place` says whether a volume can grow where it is.
    """

    def __init__(self, directory: Path, catalog: Catalog, pool_id: str = "fast", *, room_in_place: bool = False,
                 ) -> None:
        super().__init__(directory, pool_id)
        self.catalog = catalog
        self.room_in_place = room_in_place
        self._rows: list[ExtentRecord] = []

    async def load(self) -> None:
        self._rows = await self.catalog.extents(self.id)

    def homes(self, volume_id: str) -> dict[ExtentState, int]:
        """The volume's homes by state (USED, MOVING, RETIRING), each as its slot number."""
        return {row.state: row.start // SLOT for row in self._rows if row.volume_id == volume_id}

    async def create(self, image: Path, size: int, params: VolumeParameters, *, key: VolumeKey | None = None) -> None:
        await super().create(image, size, params)
        await self.catalog.take_extent(self.id, _volume_of(image), self._free_slot(size))
        await self.load()

    async def grow(self, image: Path, size: int) -> bool:
        home = self._home(_volume_of(image), ExtentState.USED)
        if home.length >= size:
            return True
        if not self.room_in_place:
            return False
        await self.catalog.set_extent_length(self.id, home.start, size, lambda rows: True)
        await self.load()
        return True

    async def reserve_move(self, image: Path, size: int) -> ImageFile:
        volume_id = _volume_of(image)
        old = self._home(volume_id, ExtentState.USED)
        new = await self.catalog.take_move_extent(self.id, volume_id, self._free_slot(max(size, old.length)))
        assert new is not None
        await self.load()
        return self._storage_at(volume_id, new)

    async def commit_move(self, image: Path, generation: int) -> None:
        if not await self.catalog.set_move_committed(self.id, _volume_of(image), generation):
            raise FailedPrecondition(f"pool {self.id} has no move under way for {image}")
        await self.load()

    async def end_move(self, image: Path, *, committed: bool) -> None:
        volume_id = _volume_of(image)
        state = ExtentState.RETIRING if committed else ExtentState.MOVING
        await self.catalog.set_extents_scrubbing(self.id, volume_id, state)
        await self._drop_scrubbed(volume_id)

    def moves_under_way(self) -> dict[str, bool]:
        moves: dict[str, bool] = {}
        for row in self._rows:
            if row.state in (ExtentState.MOVING, ExtentState.RETIRING):
                moves[row.volume_id] = moves.get(row.volume_id, False) or row.state is ExtentState.RETIRING
        return moves

    async def delete(self, image: Path) -> None:
        volume_id = _volume_of(image)
        await self.catalog.set_extents_scrubbing(self.id, volume_id)
        await self._drop_scrubbed(volume_id)
        await super().delete(image)

    def storage(self, image: Path) -> ImageFile:
        volume_id = _volume_of(image)
        return self._storage_at(volume_id, self._home(volume_id, ExtentState.USED))

    def _storage_at(self, volume_id: str, home: ExtentRecord) -> ImageFile:
        return WindowFile(self.directory / f"{volume_id}@{home.start // SLOT}")

    def _home(self, volume_id: str, state: ExtentState) -> ExtentRecord:
        found = [row for row in self._rows if row.volume_id == volume_id and row.state is state]
        if not found:
            raise FailedPrecondition(f"pool {self.id} has no {state.value} home for volume {volume_id}")
        return found[0]

    def _free_slot(self, length: int) -> Callable[[list[ExtentRecord]], ExtentChoice]:
        return lambda rows: ExtentChoice((max((row.start // SLOT for row in rows), default=-1) + 1) * SLOT, length)

    async def _drop_scrubbed(self, volume_id: str) -> None:
        for row in await self.catalog.extents(self.id):
            if row.volume_id == volume_id and row.state is ExtentState.SCRUBBING:
                await self.catalog.delete_extent(self.id, row.start)
        await self.load()


def _volume_of(image: Path) -> str:
    return image.name.split(".")[0]


class WindowFile(ImageFile):
    """A home of the moving pool: a node of its own, addressed by name, as a device pool's window is."""

    def inline_child(self, params: VolumeParameters, *, read_only: bool) -> QMPArgs | None:
        return None
