"""Volumes made, staged and published through CSI as the provisioner and kubelet do, and taken down again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from testing.harness import Sandbox


@dataclasses.dataclass(frozen=True)
class Staged:
    """A volume made, staged and (unless it is not) published through CSI, as kubelet lays out its paths."""

    id: str
    staging: Path
    target: Path



async def stage(csi: CSIClient, box: Sandbox, name: str, size: int, parameters: Mapping[str, str] | None = None,
                *, block: bool = False, fs_type: str = "", publish: bool = True,
                made: dict[str, Staged] | None = None, secrets: dict[str, str] | None = None) -> Staged:
    """CreateVolume, NodeStageVolume and NodePublishVolume (unless not `publish`) of a volume named `name`.

    `made` records the volume as soon as it exists, so a failure in between still leaves it to undo;
    `secrets` go with the create and the stage (an encrypted volume's key).
    """
    vid = (await csi.create_volume(name, size, dict(parameters or {}), block=block, fs_type=fs_type,
                                   secrets=secrets)).volume_id
    volume = Staged(vid, box.staging(name), box.target(name))
    if made is not None:
        made[vid] = volume
    await csi.stage(vid, str(volume.staging), block=block, fs_type=fs_type, secrets=secrets)
    if publish:
        await csi.publish(vid, str(volume.staging), str(volume.target), block=block, fs_type=fs_type)
    return volume



async def release(csi: CSIClient, volume: Staged, *, delete: bool = True) -> None:
    """NodeUnpublishVolume, NodeUnstageVolume and (if `delete`) DeleteVolume of `volume`."""
    await csi.unpublish(volume.id, str(volume.target))
    await csi.unstage(volume.id, str(volume.staging))
    if delete:
        await csi.delete_volume(volume.id)
