"""The node plugin's mutual-TLS listener, for the snapshot-metadata router.

Kubernetes' external-snapshot-metadata sidecar reaches one address per
driver, but each snapshot lives on one node; the router (`csi_qsd.router`)
forwards each call to the node that holds the snapshot, over this listener.
It serves the SnapshotMetadata service, Identity, and of the Controller
service only GetSnapshot (so the router can ask which node holds a snapshot):
nothing that changes a volume is reachable from the network. Off unless
`--metadata-address` is given with a certificate, key and client CA.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from csi_qsd.config import Config
from csi_qsd.csi.controller import ControllerService
from csi_qsd.csi.identity import IdentityService
from csi_qsd.csi.snapshot_metadata import SnapshotMetadataService
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import StartupError
from csi_qsd.tls import server_credentials

log = logging.getLogger(__name__)


def _get_snapshot_only(controller: ControllerService) -> grpc.GenericRpcHandler:
    """csi.v1.Controller with one method: every other Controller RPC is UNIMPLEMENTED here."""
    return grpc.method_handlers_generic_handler("csi.v1.Controller", {
        "GetSnapshot": grpc.unary_unary_rpc_method_handler(
            controller.GetSnapshot, request_deserializer=pb.GetSnapshotRequest.FromString,
            response_serializer=pb.GetSnapshotResponse.SerializeToString),
    })


@contextlib.asynccontextmanager
async def serving_metadata_listener(
    config: Config, identity: IdentityService, controller: ControllerService, metadata: SnapshotMetadataService,
) -> AsyncIterator[None]:
    """Serve the listener while the context is open; nothing when it is not configured or has no certificate.

    The certificate Secret is optional in the manifests, so a missing file
    turns the listener off with a warning instead of stopping the plugin.
    Raises StartupError when the address cannot be bound.
    """
    files = config.metadata_tls
    if not config.metadata_address or files is None:
        yield
        return
    missing = files.missing()
    if missing:
        log.warning("event=metadata_listener_off address=%s missing=%s", config.metadata_address,
                    ",".join(map(str, missing)))
        yield
        return
    server = grpc.aio.server()
    pb_grpc.add_IdentityServicer_to_server(identity, server)
    pb_grpc.add_SnapshotMetadataServicer_to_server(metadata, server)
    server.add_generic_rpc_handlers((_get_snapshot_only(controller),))
    try:
        port = server.add_secure_port(config.metadata_address, server_credentials(files))
    except (OSError, RuntimeError) as exc:
        raise StartupError(f"cannot serve snapshot metadata on {config.metadata_address!r}: {exc}") from exc
    if not port:
        raise StartupError(f"cannot serve snapshot metadata on {config.metadata_address!r}")
    await server.start()
    log.info("event=metadata_listener address=%s cert=%s client_ca=%s", config.metadata_address, files.cert, files.ca)
    try:
        yield
    finally:
        await server.stop(grace=5)
