"""The node plugin's mutual-TLS listener, for the snapshot-metadata router.

Kubernetes' external-snapshot-metadata sidecar reaches one address per
driver, but each snapshot lives on one node; the router (`csi_qsd.router`)
forwards each call to the node that holds the snapshot, over this listener.
It serves the SnapshotMetadata service, Identity, and of the Controller
service only GetSnapshot (so the router can ask which node holds a snapshot):
nothing that changes a volume is reachable from the network. Other node
plugins reach it too, for the leases of copies across nodes
(`csi_qsd.transport.copy_peers`: `handlers`), which only serve snapshots read-only.
Block maps and snapshots are for the router and this node's peers only
(`RouterAndPeers`): any other certificate of the CA is PERMISSION_DENIED
there, as on the copy service. Identity answers any. Off unless
`--metadata-address` is given with a certificate, key and client CA; waits
for those files when they are not there yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

from csi_qsd.config import Config
from csi_qsd.csi.controller import ControllerService
from csi_qsd.csi.identity import IdentityService
from csi_qsd.csi.snapshot_metadata import SnapshotMetadataService
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import PermissionDenied, StartupError
from csi_qsd.transport.tls import ROUTER_NAME, caller_name, server_credentials

log = logging.getLogger(__name__)


def _get_snapshot_only(controller: ControllerService) -> grpc.GenericRpcHandler:
    """csi.v1.Controller with one method: every other Controller RPC is UNIMPLEMENTED here."""
    return grpc.method_handlers_generic_handler("csi.v1.Controller", {
        "GetSnapshot": grpc.unary_unary_rpc_method_handler(
            controller.GetSnapshot, request_deserializer=pb.GetSnapshotRequest.FromString,
            response_serializer=pb.GetSnapshotResponse.SerializeToString),
    })


# The listener's methods that only the router and the peers may call: they tell what a snapshot holds.
ROUTER_AND_PEERS_ONLY = ("/csi.v1.SnapshotMetadata/", "/csi.v1.Controller/GetSnapshot")


class Peers(Protocol):
    """Who the other node plugins are now (`csi_qsd.transport.copy_peers.CopyPeerList`)."""

    async def current(self) -> dict[str, str]: ...


class RouterAndPeers(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuse SnapshotMetadata and GetSnapshot to any caller but the router and this node's peers.

    An interceptor cannot see the caller's certificate, but the handler it
    returns can: the method's behaviour is wrapped with the check, for
    unary and server-streaming methods alike. A refusal is PERMISSION_DENIED
    naming who the certificate says the caller is.
    """

    def __init__(self, peers: Peers | None) -> None:
        self._peers = peers

    async def admit(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """Raises PermissionDenied unless the caller is the router or a peer."""
        name = caller_name(context)
        if name and (name == ROUTER_NAME or (self._peers is not None and name in await self._peers.current())):
            return
        raise PermissionDenied(f"{method} is for the snapshot-metadata router ({ROUTER_NAME}) and this node's "
                               f"peers only; the caller's certificate names {name or 'no one of ours'!r}")

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = str(details.method)
        if handler is None or not method.startswith(ROUTER_AND_PEERS_ONLY):
            return handler
        behaviour = handler.unary_unary or handler.unary_stream
        if behaviour is None:  # no streaming requests among them
            return handler

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                await self.admit(context, method.rpartition("/")[2])
            except PermissionDenied as exc:
                log.info("rpc=%s caller=%s code=%s error=%r", method.rpartition("/")[2],
                         caller_name(context) or "-", exc.code.value, str(exc))
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            return await behaviour(request, context)

        make = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                else grpc.unary_stream_rpc_method_handler)
        return make(guarded, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


# Kubelet projects a Secret created after the pod started within about a minute (its sync period).
FILES_CHECK_INTERVAL = 15.0


def _server(config: Config, identity: IdentityService, controller: ControllerService,
            metadata: SnapshotMetadataService, handlers: tuple[grpc.GenericRpcHandler, ...] = (),
            peers: Peers | None = None) -> grpc.aio.Server:
    """The listener's server, bound. Raises StartupError when the address cannot be bound."""
    assert config.metadata_tls is not None
    server = grpc.aio.server(interceptors=(RouterAndPeers(peers),))
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
    peers: Peers | None = None,
) -> AsyncIterator[None]:
    """Serve the listener while the context is open; nothing when it is not configured.

    The certificate Secret is optional in the manifests and may be created
    after the plugin started: while a file is missing the listener is off
    (logged once) and starts as soon as all three are there, checked every
    `check_interval` seconds. Block maps and snapshots answer the router and `peers` only. Raises StartupError when the address cannot be
    bound at start; a later failure to bind is logged and ends the wait.
    """
    files = config.metadata_tls
    if not config.metadata_address or files is None:
        yield
        return
    server: grpc.aio.Server | None = None

    async def start() -> None:
        nonlocal server
        started = _server(config, identity, controller, metadata, handlers, peers)
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
