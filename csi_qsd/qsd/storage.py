"""What a volume's bytes are, as QSD opens them: the protocol node under its format node.

A pool turns its opaque storage reference into one of these; only this
module (with graph.py) knows the QMP that opens it. A new pool kind adds
its class here, e.g. a raw window (offset/size) on a host device.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

from csi_qsd.params import VolumeParameters
from csi_qsd.qsd import graph
from csi_qsd.qsd.graph import QMPArgs


class Storage(Protocol):
    def protocol_blockdev(self, nodes: graph.VolumeNodes, params: VolumeParameters, *, read_only: bool) -> QMPArgs:
        """`blockdev-add` arguments of the protocol node named `nodes.file`."""
        ...


@dataclasses.dataclass(frozen=True)
class ImageFile:
    """An image file on a local filesystem (the file pool)."""

    path: Path

    def protocol_blockdev(self, nodes: graph.VolumeNodes, params: VolumeParameters, *, read_only: bool) -> QMPArgs:
        return graph.file_blockdev(nodes, self.path, params, read_only=read_only)
