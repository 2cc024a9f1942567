"""The router's CSI services: SnapshotMetadata relayed to the owning node, and the Identity the sidecar asks for.

Each answer is streamed through message by message as the node sends it, so
the router never holds more than one message of a stream, and the sidecar's
deadline goes with the call to the node. A node's error reaches the caller
with the node's code and message (naming the node); codes the driver never
answers itself, from the connection rather than the node, become
UNAVAILABLE. A delta needs two snapshots of one volume, so base and target
on different nodes is INVALID_ARGUMENT before any node is asked for ranges.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf import wrappers_pb2

from csi_qsd.csi.errors import RpcObservers, rpc
from csi_qsd.csi.identity import IdentityService
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import Code, Forwarded, InvalidArgument, NotFound, Unavailable
from csi_qsd.router.nodes import Node, NodeDirectory
from csi_qsd.router.owners import Owners

_Service = pb.PluginCapability.Service


def forwarded(node: Node, exc: grpc.aio.AioRpcError) -> Forwarded:
    name = exc.code().name
    details = exc.details() or name
    if name in Code.__members__ and name != Code.UNAVAILABLE.value:
        return Forwarded(Code[name], f"{details} (node {node.name})")
    return Forwarded(Code.UNAVAILABLE, f"node {node.name} ({node.address}) is unavailable: {name}: {details}")


class RoutedSnapshotMetadata(pb_grpc.SnapshotMetadataServicer):
    def __init__(self, directory: NodeDirectory, owners: Owners, observers: RpcObservers | None = None) -> None:
        self.rpc_observers = observers
        self._directory = directory
        self._owners = owners

    @rpc
    async def GetMetadataAllocated(
        self, request: pb.GetMetadataAllocatedRequest, context: grpc.aio.ServicerContext
    ) -> None:
        node = await self._owners.locate(request.snapshot_id)
        call = self._directory.metadata(node).GetMetadataAllocated(request, timeout=context.time_remaining())
        await self._relay(node, call, context, (request.snapshot_id,))

    @rpc
    async def GetMetadataDelta(
        self, request: pb.GetMetadataDeltaRequest, context: grpc.aio.ServicerContext
    ) -> None:
        ids = (request.base_snapshot_id, request.target_snapshot_id)
        nodes: list[Node] | None
        try:
            nodes = await self._directory.nodes()  # one lookup for both snapshots
        except Unavailable:
            nodes = None  # each lookup says so, after checking its snapshot ID
        found = await asyncio.gather(*(self._owners.locate(i, nodes) for i in ids), return_exceptions=True)
        for failure in sorted((f for f in found if isinstance(f, BaseException)), key=lambda f: not isinstance(f, NotFound)):
            raise failure  # NOT_FOUND first: an unknown snapshot is the caller's to fix
        base, target = found
        assert isinstance(base, Node) and isinstance(target, Node)
        if base != target:
            raise InvalidArgument(f"base snapshot {ids[0]} is on node {base.name} and target snapshot {ids[1]} on "
                                  f"node {target.name}: a delta needs two snapshots of one volume")
        call = self._directory.metadata(base).GetMetadataDelta(request, timeout=context.time_remaining())
        await self._relay(base, call, context, ids)

    async def _relay(
        self, node: Node, call: grpc.aio.UnaryStreamCall, context: grpc.aio.ServicerContext, ids: tuple[str, ...],
    ) -> None:
        """Write each of the node's messages as it arrives; its error, if any, after what came before it."""
        try:
            async for message in call:
                await context.write(message)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                for snapshot_id in ids:  # deleted since, or the node moved: look again next time
                    self._owners.forget(snapshot_id)
            raise forwarded(node, exc) from None
        finally:
            call.cancel()  # no-op once finished; stops the node's work when the caller left


class RouterIdentity(IdentityService):
    """Identity of the router: the driver's name, the SnapshotMetadata service only, ready once a node is known."""

    def __init__(self, driver_name: str, ready: Callable[[], Awaitable[bool]],
                 observers: RpcObservers | None = None) -> None:
        super().__init__(driver_name, lambda: True, observers=observers)
        self._nodes_known = ready

    @rpc
    async def GetPluginCapabilities(
        self, request: pb.GetPluginCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPluginCapabilitiesResponse:
        service = pb.PluginCapability.Service(type=_Service.SNAPSHOT_METADATA_SERVICE)
        return pb.GetPluginCapabilitiesResponse(capabilities=[pb.PluginCapability(service=service)])

    @rpc
    async def Probe(self, request: pb.ProbeRequest, context: grpc.aio.ServicerContext) -> pb.ProbeResponse:
        return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=await self._nodes_known()))
