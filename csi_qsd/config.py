"""Typed settings for one driver instance.

Every setting is read once, in `cli`, from flags or `CSI_QSD_*` environment
variables, and passed down explicitly: no module reads the environment.
"""

from __future__ import annotations

import dataclasses
import enum
import socket
from pathlib import Path

from csi_qsd.datapath import LoopIO
from csi_qsd.tools import bundled

DEFAULT_DRIVER_NAME = "csi-qsd.io"
DEFAULT_STATE_DIR = Path("/var/lib/csi-qsd")
DEFAULT_TARGET_ROOT = Path("/var/lib/kubelet")
TOPOLOGY_KEY_NODE = "topology.csi-qsd.io/node"
TOPOLOGY_KEY_FUSE = "topology.csi-qsd.io/fuse"
TOPOLOGY_KEY_VHOST_USER = "topology.csi-qsd.io/vhost-user-blk"


class QSDMode(enum.Enum):
    """Who starts qemu-storage-daemon: this process, or a sibling container."""

    MANAGED = "managed"
    EXTERNAL = "external"


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one driver needs to know, resolved to absolute paths."""

    state_dir: Path
    endpoint: str = ""
    node_id: str = dataclasses.field(default_factory=socket.gethostname)
    driver_name: str = DEFAULT_DRIVER_NAME
    pool_dir: Path | None = None
    target_root: Path = DEFAULT_TARGET_ROOT
    log_level: str = "info"
    metrics_address: str = ""
    qsd_mode: QSDMode = QSDMode.MANAGED
    max_volumes: int = 0
    qsd_binary: str = dataclasses.field(default_factory=lambda: bundled("qemu-storage-daemon"))
    qemu_img: str = dataclasses.field(default_factory=lambda: bundled("qemu-img"))
    loop_io: LoopIO = LoopIO.AUTO
    qmp_timeout: float = 10.0
    failpoints: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", self.state_dir.resolve())
        pool = self.pool_dir if self.pool_dir is not None else self.state_dir / "pool"
        object.__setattr__(self, "pool_dir", pool.resolve())
        object.__setattr__(self, "target_root", self.target_root.resolve())
        if not self.endpoint:
            object.__setattr__(self, "endpoint", f"unix://{self.state_dir / 'csi.sock'}")

    @property
    def pool(self) -> Path:
        assert self.pool_dir is not None
        return self.pool_dir

    @property
    def catalog_path(self) -> Path:
        return self.state_dir / "catalog.db"

    @property
    def qsd_dir(self) -> Path:
        return self.state_dir / "qsd"

    @property
    def exports_dir(self) -> Path:
        return self.state_dir / "exports"

    @property
    def socket_path(self) -> Path:
        """The UNIX socket path of the endpoint (only unix:// endpoints are served)."""
        prefix = "unix://"
        if not self.endpoint.startswith(prefix):
            raise ValueError(f"endpoint {self.endpoint!r} must start with unix://")
        return Path(self.endpoint[len(prefix):])
