"""Where the file pool's directory comes from: a directory on the node, or a filesystem the driver manages.

`PoolDirectory.ready` runs once per start, before the catalog's reconcile or
QSD touches the pool, and leaves the directory usable. A plain directory is
made if missing; a managed one (`managed_xfs.py`) is found, made, attached,
mounted or grown as needed. A new kind is a module with a `PoolDirectory`
and one entry in `managed.py`'s table.
"""

from __future__ import annotations

import abc
import logging
from pathlib import Path

from csi_qsd.errors import StartupError

log = logging.getLogger(__name__)

# In the state directory: the files of managed pools, one per kind (`<kind>.img`), and nothing else.
MANAGED_DIR = "managed-pool"
IMAGE_SUFFIX = ".img"


def managed_images(state_dir: Path) -> list[Path]:
    """The managed pools' files in `state_dir` (whole ones, not a creation a crash cut off)."""
    return sorted((state_dir / MANAGED_DIR).glob(f"*{IMAGE_SUFFIX}"))


class PoolDirectory(abc.ABC):
    """The file pool's directory `path`, and how it is made ready for the pool at each start."""

    path: Path

    @abc.abstractmethod
    async def ready(self) -> None:
        """Make `path` hold the pool: idempotent, and finishes what a crash cut off. Raises StartupError."""

    def describe(self) -> str:
        """What the directory is, for the log."""
        return str(self.path)


class PlainDirectory(PoolDirectory):
    """A directory on the node's own filesystem (or whatever the operator mounted there)."""

    def __init__(self, path: Path, state_dir: Path) -> None:
        self.path = path
        self._state_dir = state_dir

    async def ready(self) -> None:
        """Make the directory; refuse to start when a managed pool's file says the volumes live elsewhere."""
        images = managed_images(self._state_dir)
        if images:
            kinds = ", ".join(image.name.removesuffix(IMAGE_SUFFIX) for image in images)
            raise StartupError(
                f"{images[0]} holds a managed {kinds} pool, but --managed-pool is not given: the volumes made "
                f"while it was on live in that file, not in {self.path}. Start with --managed-pool "
                f"{kinds}:SIZE (at least the file's size, {images[0].stat().st_size >> 20}Mi) to serve them, or "
                f"unmount {self.path} and move {images[0]} out of {images[0].parent} to leave them for good")
        self.path.mkdir(parents=True, exist_ok=True)
