"""A pool of qcow2/raw image files in one directory.

Image names derive from validated volume IDs only. Creation goes through a
temporary name and an atomic rename, so a crash never leaves a half-written
image under a volume's name.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from csi_qsd.catalog import DEFAULT_POOL
from csi_qsd.errors import ResourceExhausted
from csi_qsd.params import ImageFormat, Preallocation, VolumeParameters
from csi_qsd.pools.base import Pool, PoolUsage
from csi_qsd.qsd.storage import ImageFile
from csi_qsd.sys.run import run

__all__ = ["FilePool", "PoolUsage"]

TMP_SUFFIX = ".tmp"


class FilePool(Pool):
    """Image files in `directory`, one per volume."""

    def __init__(self, directory: Path, qemu_img: str = "qemu-img", pool_id: str = DEFAULT_POOL) -> None:
        self.id = pool_id
        self.directory = directory
        self._qemu_img = qemu_img

    def prepare(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def image_path(self, volume_id: str, fmt: ImageFormat, generation: int = 0) -> Path:
        """A volume's image of `generation`: 0 is the one it was created with, later ones are overlays."""
        if generation == 0:
            return self.directory / f"{volume_id}.{fmt.value}"
        return self.directory / f"{volume_id}.{generation}.qcow2"

    def usage(self) -> PoolUsage:
        st = os.statvfs(self.directory)
        return PoolUsage(total=st.f_blocks * st.f_frsize, available=st.f_bavail * st.f_frsize)

    async def create(self, image: Path, size: int, params: VolumeParameters) -> None:
        """Create `image` of `size` bytes; RESOURCE_EXHAUSTED if the pool cannot hold it."""
        available = self.usage().available
        if size > available:
            raise ResourceExhausted(
                f"pool {self.directory} has {available} bytes free, volume needs {size}"
            )
        tmp = image.with_name(image.name + TMP_SUFFIX)
        tmp.unlink(missing_ok=True)
        argv = [self._qemu_img, "create", "-q", "-f", params.format.value]
        options = []
        if params.preallocation is not Preallocation.OFF:
            options.append(f"preallocation={params.preallocation.value}")
        if params.format is ImageFormat.QCOW2:
            options.append("lazy_refcounts=off")
        if options:
            argv += ["-o", ",".join(options)]
        try:
            await run(*argv, str(tmp), str(size), timeout=3600)
            await asyncio.to_thread(_fsync_and_rename, tmp, image)
        finally:
            tmp.unlink(missing_ok=True)

    async def create_overlay(self, image: Path, backing: Path, size: int) -> None:
        """Create a thin qcow2 `image` over `backing` (same directory, named relatively): O(1)."""
        tmp = image.with_name(image.name + TMP_SUFFIX)
        tmp.unlink(missing_ok=True)
        backing_format = "qcow2" if backing.suffix == ".qcow2" else "raw"
        try:
            # -u: the size is given, so the backing chain need not be opened (saves milliseconds per layer).
            await run(self._qemu_img, "create", "-q", "-f", "qcow2", "-u", "-o", "lazy_refcounts=off",
                      "-b", backing.name, "-F", backing_format, str(tmp), str(size))
            await asyncio.to_thread(_fsync_and_rename, tmp, image)
        finally:
            tmp.unlink(missing_ok=True)

    async def backing_of(self, image: Path) -> str:
        """The absolute backing file an image's header names, or ''."""
        _, out = await run(self._qemu_img, "info", "--force-share", "--output=json", str(image))
        info = json.loads(out)
        return str(info.get("full-backing-filename", "") or "")

    async def flatten(self, image: Path) -> None:
        """Copy everything the backing chain holds into `image` and drop its backing (offline).

        qemu-img rewrites the header last, so a crash midway leaves the old, valid chain.
        """
        await run(self._qemu_img, "rebase", "-q", "-f", "qcow2", "-b", "", str(image), timeout=24 * 3600)

    async def delete(self, image: Path) -> None:
        await asyncio.to_thread(_unlink_durably, image)

    def leftovers(self) -> list[Path]:
        """Temporary files a crash left during creation: never user data."""
        return sorted(self.directory.glob(f"vol-*{TMP_SUFFIX}"))

    def images(self) -> list[Path]:
        return sorted(p for p in self.directory.glob("vol-*") if not p.name.endswith(TMP_SUFFIX))

    def storage(self, image: Path) -> ImageFile:
        return ImageFile(image)


def _fsync_and_rename(tmp: Path, image: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, image)
    _fsync_dir(image.parent)


def _unlink_durably(image: Path) -> None:
    image.unlink(missing_ok=True)
    _fsync_dir(image.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
