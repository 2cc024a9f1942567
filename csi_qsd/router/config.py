"""Typed settings of the snapshot-metadata router, built by `cli` from flags and environment."""

from __future__ import annotations

import dataclasses
import re

from csi_qsd.config import DEFAULT_DRIVER_NAME
from csi_qsd.sys import endpoint as unix_endpoint
from csi_qsd.sys.pem import PemFiles
from csi_qsd.validate import check_address

DEFAULT_SERVER_NAME = "csi-qsd-node"
# A node name as Kubernetes allows it (DNS subdomain).
_NODE_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")


@dataclasses.dataclass(frozen=True)
class NodeAddress:
    """`--node NAME=HOST:PORT`: where one node plugin's metadata listener answers."""

    name: str
    address: str

    @classmethod
    def parse(cls, text: str) -> "NodeAddress":
        """Parse NAME=HOST:PORT; raises ValueError naming what is wrong."""
        name, eq, address = text.partition("=")
        if not eq or not _NODE_NAME_RE.match(name):
            raise ValueError(f"--node {text!r}: expected NAME=HOST:PORT with a node name")
        return cls(name, check_address(address, f"--node {name}"))


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs: where to serve, where the nodes are, and its TLS identity."""

    endpoint: str
    tls: PemFiles
    nodes: tuple[NodeAddress, ...] = ()
    nodes_dns: str = ""
    driver_name: str = DEFAULT_DRIVER_NAME
    server_name: str = DEFAULT_SERVER_NAME
    node_timeout: float = 5.0
    cache_size: int = 65536
    log_level: str = "info"

    def __post_init__(self) -> None:
        unix_endpoint.socket_path(self.endpoint)
        if bool(self.nodes) == bool(self.nodes_dns):
            raise ValueError("give the node plugins either as --node NAME=HOST:PORT (repeatable) or as --nodes-dns")
        if self.nodes_dns:
            check_address(self.nodes_dns, "--nodes-dns")
        names = [node.name for node in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique: {names}")
