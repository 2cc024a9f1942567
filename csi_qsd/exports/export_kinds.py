"""Which export path serves a volume: one line per kind."""

from __future__ import annotations

from csi_qsd.catalog import VolumeRecord
from csi_qsd.exports.base import ExportHost, ExportPath
from csi_qsd.exports.fuse_loop import FuseLoopExport
from csi_qsd.exports.vhost_user import VhostUserExport
from csi_qsd.params import ExportKind

KINDS: dict[ExportKind, type[ExportPath]] = {
    ExportKind.FILESYSTEM: FuseLoopExport,
    ExportKind.VHOST_USER_BLK: VhostUserExport,
}


class ExportPaths:
    """One instance of every kind, sharing the host; picks a volume's kind by its parameters."""

    def __init__(self, host: ExportHost) -> None:
        self.host = host
        self._kinds = {kind: cls(host) for kind, cls in KINDS.items()}

    def of(self, volume: VolumeRecord) -> ExportPath:
        return self._kinds[volume.params.export]

    def export_broken(self, volume_id: str) -> bool:
        """True if any kind sees the volume's export cut off from QSD (its errno says so)."""
        return any(kind.export_broken(volume_id) for kind in self._kinds.values())
