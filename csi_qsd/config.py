"""Typed settings for one driver instance.

Every setting is read once, in `cli`, from flags or `CSI_QSD_*` environment
variables, and passed down explicitly: no module reads the environment.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from pathlib import Path

from csi_qsd.params import DEFAULT_POOL_NAME, POOL_NAME_RE
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pool_specs.managed_spec import ManagedPoolSpec
from csi_qsd.pool_specs.remote_spec import RemotePoolSpec
from csi_qsd.qsd.features import FuseThreads, LoopIO
from csi_qsd.qsd.file_aio import FileIO
from csi_qsd.qsd.iothreads import check_size as check_iothreads
from csi_qsd.qsd.iothreads import node_cores
from csi_qsd.qsd.settings import QSDMode
from csi_qsd.qsd.shards import check_count as check_shards
from csi_qsd.sys import endpoint as unix_endpoint
from csi_qsd.sys.pem import PemFiles
from csi_qsd.sys.runtime import DEFAULT_RUNTIME_DIR
from csi_qsd.sys.tools import bundled

DEFAULT_DRIVER_NAME = "csi-qsd.io"
DEFAULT_STATE_DIR = Path("/var/lib/csi-qsd")
DEFAULT_TARGET_ROOT = Path("/var/lib/kubelet")
TOPOLOGY_KEY_NODE = "topology.csi-qsd.io/node"
DEFAULT_COPY_LEASE_TTL = 86400.0  # a day: a copy's node away that long loses its copy (docs/security.md)
DEFAULT_COPY_CALLS_PER_NODE = 16  # copy calls one node may have in flight here (docs/security.md)
TOPOLOGY_KEY_FUSE = "topology.csi-qsd.io/fuse"
TOPOLOGY_KEY_VHOST_USER = "topology.csi-qsd.io/vhost-user-blk"
# An iothread's adaptive polling budget, as the StorageClass's iothreadPollMaxNs allows it.
POLL_MAX_NS_RANGE = range(0, 1_000_001)



def parse_remote_pool(text: str) -> RemotePoolSpec:
    """`--remote-pool NAME=URL[,...]` (`csi_qsd.pool_specs.remote_spec`); raises ValueError naming the flag."""
    return RemotePoolSpec.parse(text, POOL_NAME_RE, DEFAULT_POOL_NAME)


def bracketed(address: str) -> str:
    """HOST:PORT with an IPv6 host in brackets (`fd00::5:9811` -> `[fd00::5]:9811`), as gRPC wants it."""
    host, colon, port = address.rpartition(":")
    return f"[{host}]:{port}" if colon and ":" in host and not host.startswith("[") else address


def is_loopback(host: str) -> bool:
    """True for an address (or the name localhost) that only this host reaches."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one driver needs to know, resolved to absolute paths."""

    state_dir: Path
    endpoint: str = ""
    node_id: str = dataclasses.field(default_factory=socket.gethostname)
    driver_name: str = DEFAULT_DRIVER_NAME
    pool_dir: Path | None = None
    # The pool directory on a filesystem the driver makes in a file of the state dir (`csi_qsd.pools.managed_xfs`).
    managed_pool: ManagedPoolSpec | None = None
    target_root: Path = DEFAULT_TARGET_ROOT
    log_level: str = "info"
    metrics_address: str = ""
    qsd_mode: QSDMode = QSDMode.MANAGED
    max_volumes: int = 0
    qsd_binary: str = dataclasses.field(default_factory=lambda: bundled("qemu-storage-daemon"))
    qemu_img: str = dataclasses.field(default_factory=lambda: bundled("qemu-img"))
    loop_io: LoopIO = LoopIO.AUTO
    file_io: FileIO = FileIO.AUTO  # how QSD reads and writes the file pool's images (`csi_qsd.qsd.file_aio`)
    qmp_timeout: float = 10.0
    failpoints: str = ""
    # QSD's pool of iothreads for exports (`csi_qsd.qsd.iothreads`): default one per core, and their
    # polling budget in ns (None: QEMU's default).
    iothreads: int = dataclasses.field(default_factory=node_cores)
    poll_max_ns: int | None = None
    fuse_threads: FuseThreads = FuseThreads.AUTO
    # QSD processes serving this node's volumes, each from its own main loop (`csi_qsd.qsd.shards`).
    qsd_shards: int = 1
    device_pools: tuple[DevicePoolSpec, ...] = ()
    # Device pools on remote targets through QEMU's own drivers (iSCSI, NBD): `csi_qsd.pools.remote`.
    remote_pools: tuple[RemotePoolSpec, ...] = ()
    # The mutual-TLS listener for the snapshot-metadata router (host:port; empty: off).
    metadata_address: str = ""
    metadata_tls: PemFiles | None = None
    # Copies across nodes (`csi_qsd.controller.copy_targets`): the other node plugins' listeners (NAME, HOST:PORT),
    # where this node serves its snapshots to them over NBD (host; default the listener's), on which ports,
    # and how fast a copy streams (bytes/s, 0: no limit). They use the listener's TLS files.
    peers: tuple[tuple[str, str], ...] = ()
    # Or found in the Kubernetes API: the running pods of this namespace that match this label selector
    # (`csi_qsd.transport.copy_peer_pods`), through the API server at `kubernetes_api` (host:port, given to every pod).
    peers_from_pods: str = ""
    kubernetes_api: str = ""
    # Label the hand-made VolumeSnapshotContents whose snapshot this node holds with this node's name, so its
    # csi-snapshotter takes them (`csi_qsd.csi.snapshot_contents`).
    claim_snapshot_contents: bool = False
    # After a rebuild cut pods off a filesystem or block volume (`csi_qsd.csi.heal_pods`): delete those a
    # controller makes again (in a pod only; outside one the volume's condition alone says so).
    delete_pods_on_rebuild: bool = True
    copy_address: str = ""
    copy_ports: range = range(10900, 11000)
    copy_rate: int = 0
    copy_lease_ttl: float = DEFAULT_COPY_LEASE_TTL  # seconds a served lease outlives its copy's last request (0: ever)
    # What one calling node may hold of this node's copy service: leases (0: half of --copy-ports) and calls
    # in flight, so that one node, or one stolen certificate, cannot take every port (docs/security.md).
    copy_leases_per_node: int = 0
    copy_calls_per_node: int = DEFAULT_COPY_CALLS_PER_NODE
    # tmpfs where QEMU's copies of the node's TLS files live while QEMU loads them (`csi_qsd.sys.runtime`).
    runtime_dir: Path = DEFAULT_RUNTIME_DIR

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", self.state_dir.resolve())
        pool = self.pool_dir if self.pool_dir is not None else self.state_dir / "pool"
        object.__setattr__(self, "pool_dir", pool.resolve())
        object.__setattr__(self, "target_root", self.target_root.resolve())
        check_iothreads(self.iothreads, node_cores())
        if self.poll_max_ns is not None and self.poll_max_ns not in POLL_MAX_NS_RANGE:
            raise ValueError(f"poll-max-ns {self.poll_max_ns}: must be 0..{POLL_MAX_NS_RANGE.stop - 1}")
        check_shards(self.qsd_shards)
        names = [spec.name for spec in self.device_pools] + [spec.name for spec in self.remote_pools]
        if len(set(names)) != len(names):
            raise ValueError(f"device and remote pool names must be unique: {names}")
        # $(POD_IP):PORT from the downward API is an IPv6 address without brackets on an IPv6 cluster.
        object.__setattr__(self, "metadata_address", bracketed(self.metadata_address))
        if self.metadata_address and self.metadata_tls is None:
            raise ValueError("--metadata-address needs --metadata-cert, --metadata-key and --metadata-client-ca")
        if not self.endpoint:
            object.__setattr__(self, "endpoint", f"unix://{self.state_dir / 'csi.sock'}")
        if self.peers and self.metadata_tls is None:
            raise ValueError("--peer needs the node-to-node TLS files: --metadata-cert, --metadata-key and "
                             "--metadata-client-ca")
        self._check_peers_from_pods()
        if self.claim_snapshot_contents and not self.kubernetes_api:
            raise ValueError("--claim-snapshot-contents asks the Kubernetes API, and this is not a pod: "
                             "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
        remote = [f"--peer {name} is" for name, address in self.peers if not is_loopback(address.rpartition(":")[0])]
        remote += ["--peers-from-pods finds pods on other hosts"] if self.peers_from_pods else []
        if remote and is_loopback(self.copy_host):
            raise ValueError(
                f"{remote[0]} another host, but this node would serve its copies on {self.copy_host}, "
                "which no other host reaches: set --copy-address to this node's own address (deploy/node.yaml "
                "gives the pod's IP from the downward API)" + ("" if self.copy_address else
                                                              f", or a --metadata-address host other than "
                                                              f"{self.metadata_address or 'none'}"))
        if not self.copy_ports or self.copy_ports.start < 1 or self.copy_ports.stop > 65536:
            raise ValueError(f"--copy-ports {self.copy_ports.start}-{self.copy_ports.stop - 1}: not a port range")
        if self.copy_rate < 0:
            raise ValueError("--copy-rate must not be negative")
        if self.copy_lease_ttl < 0:
            raise ValueError("--copy-lease-ttl must not be negative")
        if not 0 <= self.copy_leases_per_node <= len(self.copy_ports):
            raise ValueError(f"--copy-leases-per-node {self.copy_leases_per_node}: must be 0 (half of --copy-ports) "
                             f"to {len(self.copy_ports)} (the number of --copy-ports)")
        if self.copy_calls_per_node < 1:
            raise ValueError(f"--copy-calls-per-node {self.copy_calls_per_node}: must be at least 1")
        self._check_runtime_dir()
        self._check_managed_pool()

    def _check_managed_pool(self) -> None:
        """--managed-pool mounts over the pool directory: it must hide none of the driver's other directories."""
        if self.managed_pool is None:
            return
        for flag, other in (("--state-dir", self.state_dir), ("--target-root", self.target_root),
                            ("--runtime-dir", self.runtime_dir)):
            if other.is_relative_to(self.pool):
                raise ValueError(f"--managed-pool mounts a filesystem at --pool-dir {self.pool}, which would hide "
                                 f"{flag} {other}: give the pool a directory of its own (default <state-dir>/pool)")

    def _check_runtime_dir(self) -> None:
        """--runtime-dir: absolute, and apart from every persistent directory (a key written there stays)."""
        if not self.runtime_dir.is_absolute():
            raise ValueError(f"--runtime-dir {self.runtime_dir}: must be an absolute path")
        runtime_dir = self.runtime_dir.resolve()
        object.__setattr__(self, "runtime_dir", runtime_dir)
        for flag, persistent in (("--state-dir", self.state_dir), ("--pool-dir", self.pool),
                                 ("--target-root", self.target_root)):
            if runtime_dir.is_relative_to(persistent) or persistent.is_relative_to(runtime_dir):
                raise ValueError(f"--runtime-dir {runtime_dir} overlaps {flag} {persistent}: it holds private keys "
                                 "while QEMU loads them and belongs on tmpfs apart from persistent directories "
                                 f"(default {DEFAULT_RUNTIME_DIR})")

    def _check_peers_from_pods(self) -> None:
        if not self.peers_from_pods:
            return
        if self.peers:
            raise ValueError("give the other nodes either with --peer or with --peers-from-pods, not both")
        if not self.metadata_address:
            raise ValueError("--peers-from-pods needs --metadata-address: the other nodes' plugins are called "
                             "at its port on their pod IPs")
        if self.metadata_tls is None:
            raise ValueError("--peers-from-pods needs the node-to-node TLS files: --metadata-cert, --metadata-key "
                             "and --metadata-client-ca")
        if not self.kubernetes_api:
            raise ValueError("--peers-from-pods asks the Kubernetes API, and this is not a pod: "
                             "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")

    @property
    def copies_with_peers(self) -> bool:
        """True if this node restores and clones from other nodes (it knows them one way or the other)."""
        return bool(self.peers or self.peers_from_pods)

    @property
    def metadata_port(self) -> int:
        return int(self.metadata_address.rpartition(":")[2]) if self.metadata_address else 0

    @property
    def copy_host(self) -> str:
        """Where this node serves snapshots to copies on other nodes: --copy-address, else the listener's host."""
        if self.copy_address:
            return self.copy_address
        host = self.metadata_address.rpartition(":")[0].strip("[]")
        return host if host and host not in ("0.0.0.0", "::") else "127.0.0.1"

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
        return unix_endpoint.socket_path(self.endpoint)
