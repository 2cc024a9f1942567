"""Filesystem volumes: loop device → (mkfs once) → mount at staging → bind to targets."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from csi_qsd.errors import AlreadyExists, FailedPrecondition
from csi_qsd.sys import filesystems, mounts
from csi_qsd.sys.loop import device_size


def _devno(device: Path) -> str:
    rdev = os.stat(device).st_rdev
    return f"{os.major(rdev)}:{os.minor(rdev)}"


async def ensure_staged(loop: Path, staging: Path, fs_type: str, flags: list[str], *, blank: bool = False) -> str:
    """Mount the volume's filesystem at `staging`, creating it only if the device holds none.

    `blank`: the volume is known to read as zeros (its pool says so from its
    metadata), so there is nothing to probe for.

    Returns the filesystem type mounted. Raises FailedPrecondition when the
    device holds another filesystem than asked, or `staging` holds another mount.
    """
    entry = mounts.mounted_at(staging)
    if entry is not None:
        if entry.major_minor == _devno(loop):
            return entry.fs_type
        raise FailedPrecondition(f"staging path {staging} already has {entry.source} mounted")
    existing = "" if blank else await filesystems.probe(loop)
    made = not existing
    if made:
        filesystems.check_fits(fs_type, device_size(loop))
        await filesystems.make(loop, fs_type, zeroed=blank)
        existing = fs_type
    elif existing != fs_type:
        raise FailedPrecondition(
            f"volume holds a {existing} filesystem but {fs_type} was requested; "
            f"use fsType {existing} or a new volume"
        )
    staging.mkdir(mode=0o750, exist_ok=True)
    # A volume restored or cloned into a larger size, or expanded while unstaged,
    # carries a smaller filesystem: grow it to the device. ext4 grows before the
    # mount (online growth needs CAP_SYS_RESOURCE), xfs only while mounted.
    if existing == "ext4" and not made:  # a filesystem just made fills its device
        await filesystems.grow_ext4_offline(loop)
    await mounts.mount(loop, staging, fs_type=existing, options=_mount_options(existing, flags))
    if existing == "xfs":
        await filesystems.grow(staging, existing, loop)
    return existing


def _mount_options(fs_type: str, flags: list[str]) -> list[str]:
    # Restores and clones share their source's XFS UUID; XFS refuses a second mount without this.
    return [*flags, "nouuid"] if fs_type == "xfs" and "nouuid" not in flags else flags


async def ensure_published(staging: Path, target: Path, *, readonly: bool, flags: list[str],
                           cover: Callable[[mounts.MountEntry], bool] | None = None) -> None:
    """Bind the staged filesystem at `target`; one there already is fine, another volume is AlreadyExists.

    A mount at `target` that `cover` says is dead is mounted over rather than
    removed: a container that took the target with mountPropagation
    HostToContainer (a slave of that mount) receives the new mount on top of
    its dead one, where a new mount beside it would never reach it.
    """
    staged = mounts.mounted_at(staging)
    if staged is None:
        raise FailedPrecondition(f"volume is not mounted at its staging path {staging}; stage it first")
    _require_parent(target)
    target.mkdir(mode=0o750, exist_ok=True)
    entry = mounts.mounted_at(target)
    if entry is not None and entry.major_minor != staged.major_minor and cover is not None and cover(entry):
        entry = None
    if entry is not None:
        if entry.major_minor != staged.major_minor:
            raise AlreadyExists(f"target {target} already has another volume mounted")
        if entry.readonly != readonly:
            raise AlreadyExists(f"target {target} is already published with readonly={entry.readonly}")
        return
    await mounts.bind(staging, target, readonly=readonly, options=flags)


async def unpublish(target: Path, *, lazy: bool = False) -> None:
    await mounts.unmount(target, lazy=lazy)
    if target.is_dir():
        try:
            target.rmdir()
        except OSError:
            pass  # not empty: something else lives there; leave it to the CO


async def unstage(staging: Path, *, lazy: bool = False) -> None:
    await mounts.unmount(staging, lazy=lazy)


def _require_parent(target: Path) -> None:
    if not target.parent.is_dir():
        raise FailedPrecondition(f"the parent directory of target {target} does not exist; the CO creates it")
