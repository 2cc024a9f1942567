"""The node plugin's mutual-TLS listener, for the snapshot-metadata router.

Kubernetes' external-snapshot-metadata sidecar reaches one address per
driver, but each snapshot lives on one node; the router (`csi_qsd.router`)
forwards each call to the node that holds the snapshot, over this listener.
It serves the SnapshotMetadata service, Identity, and of the Controller
service only GetSnapshot (so the router can ask which node holds a snapshot):
nothing that changes a volume is reachable from the network. Other node
plugins reach it too, for the leases of copies across nodes
(`csi_qsd.csi.peers`: `handlers`), which only serve snapshots read-only. Off unless
`--metadata-address` is given with a certificate, key and client CA; waits
for those files when they are not there yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from csi_qsd.config import Config
from csi_qsd.csi.controller import ControllerService
from csi_qsd.csi.identity import IdentityService
from csi_qsd.csi.snapshot_metadata import SnapshotMetadataService
from csi_qsd.csi.tls import server_credentials
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import StartupError

log = logging.getLogger(__name__)


def _get_snapshot_only(controller: ControllerService) -> grpc.GenericRpcHandler:
    """csi.v1.Controller with one method: every other Controller RPC is UNIMPLEMENTED here."""
    return grpc.method_handlers_generic_handler("csi.v1.Controller", {
        "GetSnapshot": grpc.unary_unary_rpc_method_handler(
            controller.GetSnapshot, request_deserializer=pb.GetSnapshotRequest.FromString,
            response_serializer=pb.GetSnapshotResponse.SerializeToString),
    })


# Kubelet projects a Secret created after the pod started within about a minute (its sync period).
FILES_CHECK_INTERVAL = 15.0


def _server(config: Config, identity: IdentityService, controller: ControllerService,
            metadata: SnapshotMetadataService, handlers: tuple[grpc.GenericRpcHandler, ...] = ()) -> grpc.aio.Server:
    """The listener's server, bound. Raises StartupError when the address cannot be bound."""
    assert config.metadata_tls is not None
    server = grpc.aio.server()
    pb_grpc.add_IdentityServicer_to_server(identity, server)
    pb_grpc.add_SnapshotMetadataServicer_to_server(metadata, server)
    server.add_generic_rpc_handlers((_get_snapshot_only(controller), *handlers))
    try:
        port = server.add_secure_port(config.metadata_address, server_credentials(config.metadata_tls))
    except (OSError, RuntimeError) as exc:
        raise StartupError(f"cannot serve snapshot metadata on {config.metadata_address!r}: {exc}") from exc
    if not port:
        raise StartupError(f"cannot serve snapshot metadata on {config.metadata_address!r}")
    return server


@contextlib.asynccontextmanager
async def serving_metadata_listener(
    config: Config, identity: IdentityService, controller: ControllerService, metadata: SnapshotMetadataService,
    *, check_interval: float = FILES_CHECK_INTERVAL, handlers: tuple[grpc.GenericRpcHandler, ...] = (),
) -> AsyncIterator[None]:
    """Serve the listener while the context is open; nothing when it is not configured.

    The certificate Secret is optional in the manifests and may be created
    after the plugin started: while a file is missing the listener is off
    (logged once) and starts as soon as all three are there, checked every
    `check_interval` seconds. Raises StartupError when the address cannot be
    bound at start; a later failure to bind is logged and ends the wait.
    """
    files = config.metadata_tls
    if not config.metadata_address or files is None:
        yield
        return
    server: grpc.aio.Server | None = None

    async def start() -> None:
        nonlocal server
        started = _server(config, identity, controller, metadata, handlers)
        await started.start()
        server = started
        log.info("event=metadata_listener address=%s cert=%s client_ca=%s", config.metadata_address, files.cert,
                 files.ca)

    async def start_when_files_appear() -> None:
        while files.missing():
            await asyncio.sleep(check_interval)
        try:
            await start()
        except StartupError as exc:
            log.error("event=metadata_listener_failed error=%r", str(exc))

    waiter: asyncio.Task[None] | None = None
    missing = files.missing()
    if missing:
        log.warning("event=metadata_listener_waiting address=%s missing=%s", config.metadata_address,
                    ",".join(map(str, missing)))
        waiter = asyncio.create_task(start_when_files_appear(), name="metadata-listener-wait")
    else:
        await start()
    try:
        yield
    finally:
        if waiter is not None:
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
        if server is not None:
            await server.stop(grace=5)
