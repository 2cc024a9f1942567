"""What the QSD supervisor needs to know of the driver's settings, without depending on them.

`csi_qsd.config.Config` satisfies `QSDSettings`; the supervisor reads only
these fields, so `qsd/` sits below the configuration that assembles it.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Protocol

from csi_qsd.qsd.features import FuseThreads, LoopIO


class QSDMode(enum.Enum):
    """Who starts qemu-storage-daemon: this process, or a sibling container."""

    MANAGED = "managed"
    EXTERNAL = "external"


class QSDSettings(Protocol):
    """The settings of one QSD: where it lives, how it is started, and its threads."""

    @property
    def node_id(self) -> str: ...
    @property
    def qsd_dir(self) -> Path: ...
    @property
    def qsd_mode(self) -> QSDMode: ...
    @property
    def qsd_binary(self) -> str: ...
    @property
    def qmp_timeout(self) -> float: ...
    @property
    def loop_io(self) -> LoopIO: ...
    @property
    def iothreads(self) -> int: ...
    @property
    def poll_max_ns(self) -> int | None: ...
    @property
    def fuse_threads(self) -> FuseThreads: ...
