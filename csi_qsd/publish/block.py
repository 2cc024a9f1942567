"""Raw block volumes: the loop device bind-mounted onto a file at the target path."""

from __future__ import annotations

from pathlib import Path

from csi_qsd.errors import AlreadyExists, FailedPrecondition
from csi_qsd.sys import mounts


def _published_device(target: Path) -> str | None:
    """The device name bind-mounted at `target`, or None."""
    entry = mounts.mounted_at(target)
    return None if entry is None else entry.root.rsplit("/", 1)[-1]


async def ensure_published(device: Path, target: Path, *, readonly: bool) -> None:
    """Make `target` a file carrying `device`. Readonly comes from a read-only loop device."""
    current = _published_device(target)
    if current is not None:
        if current != device.name:
            raise AlreadyExists(f"target {target} already carries another device ({current})")
        return
    if not target.parent.is_dir():
        raise FailedPrecondition(f"the parent directory of target {target} does not exist; the CO creates it")
    if target.is_dir():
        target.rmdir()
    target.touch(mode=0o600, exist_ok=True)
    await mounts.bind(device, target, readonly=readonly, options=[])


async def unpublish(target: Path, *, lazy: bool = False) -> None:
    await mounts.unmount(target, lazy=lazy)
    if target.is_file():
        target.unlink()
