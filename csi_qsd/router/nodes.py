"""Where the node plugins' metadata listeners are, and one mutual-TLS channel to each.

Two sources: a static map (`--node NAME=HOST:PORT`, for tests and small
clusters) or a DNS name that resolves to every node plugin (`--nodes-dns`, a
headless Service over the DaemonSet's pods, with not-ready pods published so
that a node whose plugin is down answers UNAVAILABLE rather than vanishing).
DNS is resolved on every lookup (a cached owner is checked against the
answer), so new nodes are seen without a restart. The client certificate is reread when its files
change; channels made with the old one are kept open for the streams still
using them and closed with the router.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket

import grpc

from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import StartupError, Unavailable
from csi_qsd.router.config import RouterConfig
from csi_qsd.transport.tls import RECONNECT_OPTIONS, ReloadingCredentials

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Node:
    """One node plugin: its name (for messages and logs) and its listener's host:port."""

    name: str
    address: str


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


class NodeDirectory:
    """The node plugins and their channels; the one place that opens connections to them."""

    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        self._static = [Node(n.name, n.address) for n in config.nodes]
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[grpc.aio.Channel] = []
        try:
            self._credentials = ReloadingCredentials(config.tls)
        except OSError as exc:
            raise StartupError(f"cannot read the router's TLS files: {exc}") from exc

    async def nodes(self) -> list[Node]:
        """Every node plugin known now. Raises Unavailable when the DNS name cannot be resolved."""
        if self._static:
            return list(self._static)
        host, _, port = self._config.nodes_dns.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise Unavailable(f"cannot resolve the node plugins' name {host!r}: {exc.strerror}") from None
        ips = sorted({str(info[4][0]) for info in infos})
        return [Node(ip, _host_port(ip, int(port))) for ip in ips]

    def metadata(self, node: Node) -> pb_grpc.SnapshotMetadataStub:
        return pb_grpc.SnapshotMetadataStub(self._channel(node.address))

    def controller(self, node: Node) -> pb_grpc.ControllerStub:
        return pb_grpc.ControllerStub(self._channel(node.address))

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials.refresh():
            self._retired.extend(self._channels.values())
            self._channels = {}
        channel = self._channels.get(address)
        if channel is None:
            options = (("grpc.ssl_target_name_override", self._config.server_name), *RECONNECT_OPTIONS)
            channel = grpc.aio.secure_channel(address, self._credentials.credentials, options=options)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels = [*self._channels.values(), *self._retired]
        self._channels, self._retired = {}, []
        await asyncio.gather(*(channel.close() for channel in channels))
