"""Assemble the router: node directory → owner cache → gRPC server on the sidecar's UNIX socket."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from csi_qsd.csi.errors import RpcObservers
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import DriverError
from csi_qsd.router.config import RouterConfig
from csi_qsd.router.nodes import NodeDirectory
from csi_qsd.router.owners import Owners
from csi_qsd.router.service import RoutedSnapshotMetadata, RouterIdentity
from csi_qsd.transport import unix_socket

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def serving_router(config: RouterConfig, observers: RpcObservers | None = None) -> AsyncIterator[None]:
    """Serve the router until the context exits. Raises StartupError when its TLS files cannot be read."""
    directory = NodeDirectory(config)
    owners = Owners(directory, config.node_timeout, config.cache_size)

    async def ready() -> bool:
        try:
            return bool(await directory.nodes())
        except DriverError:
            return False

    server = grpc.aio.server()
    pb_grpc.add_IdentityServicer_to_server(RouterIdentity(config.driver_name, ready, observers), server)
    pb_grpc.add_SnapshotMetadataServicer_to_server(RoutedSnapshotMetadata(directory, owners, observers), server)
    try:
        async with unix_socket.serving(server, config.endpoint):
            nodes = ",".join(f"{n.name}={n.address}" for n in config.nodes) or f"dns:{config.nodes_dns}"
            log.info("event=router_serving endpoint=%s nodes=%s", config.endpoint, nodes)
            yield
    finally:
        await directory.close()
