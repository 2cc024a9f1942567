"""CSI Controller service: volume lifecycle on this node's pool."""

from __future__ import annotations

import grpc
from google.protobuf import wrappers_pb2

from csi_qsd import validate
from csi_qsd.catalog import VolumeRecord
from csi_qsd.config import Config, TOPOLOGY_KEY_NODE
from csi_qsd.csi import convert
from csi_qsd.csi.errors import rpc
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import InvalidArgument, NotFound, ResourceExhausted, Unimplemented
from csi_qsd.params import parse_parameters
from csi_qsd.volumes import MIB, Volumes, unsupported_capability

_RPC = pb.ControllerServiceCapability.RPC.Type
CAPABILITIES = (
    _RPC.CREATE_DELETE_VOLUME, _RPC.LIST_VOLUMES, _RPC.GET_CAPACITY, _RPC.GET_VOLUME,
    _RPC.SINGLE_NODE_MULTI_WRITER,
)


class ControllerService(pb_grpc.ControllerServicer):
    def __init__(self, config: Config, volumes: Volumes) -> None:
        self._config = config
        self._volumes = volumes

    def _volume_message(self, record: VolumeRecord) -> pb.Volume:
        return pb.Volume(
            volume_id=record.id, capacity_bytes=record.capacity,
            volume_context={"export": record.params.export.value, "format": record.params.format.value},
            accessible_topology=[pb.Topology(segments={TOPOLOGY_KEY_NODE: self._config.node_id})],
        )

    @rpc
    async def CreateVolume(
        self, request: pb.CreateVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateVolumeResponse:
        name = validate.name(request.name)
        caps = convert.capabilities(list(request.volume_capabilities))
        params = parse_parameters(dict(request.parameters))
        if request.HasField("volume_content_source"):
            raise InvalidArgument("volume_content_source is not supported: this driver cannot pre-populate volumes yet")
        if request.HasField("accessibility_requirements"):
            requisite = list(request.accessibility_requirements.requisite)
            if requisite and not convert.topology_allows(self._config, requisite):
                raise ResourceExhausted(
                    f"volume {name!r} cannot be placed: requisite topology excludes node {self._config.node_id!r}"
                )
        record = await self._volumes.create(
            name, request.capacity_range.required_bytes, request.capacity_range.limit_bytes, params, caps
        )
        return pb.CreateVolumeResponse(volume=self._volume_message(record))

    @rpc
    async def DeleteVolume(
        self, request: pb.DeleteVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteVolumeResponse:
        if not request.volume_id:
            raise InvalidArgument("volume_id is required")
        if validate.VOLUME_ID_RE.match(request.volume_id):
            await self._volumes.delete(request.volume_id)
        return pb.DeleteVolumeResponse()

    @rpc
    async def ValidateVolumeCapabilities(
        self, request: pb.ValidateVolumeCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ValidateVolumeCapabilitiesResponse:
        volume_id = validate.volume_id(request.volume_id)
        caps = convert.capabilities(list(request.volume_capabilities))
        record = await self._volumes.get(volume_id)
        if record is None:
            raise NotFound(f"volume {volume_id} does not exist")
        params = parse_parameters(dict(request.parameters))
        if request.parameters and params != record.params:
            return pb.ValidateVolumeCapabilitiesResponse(message="parameters differ from the volume's")
        for cap in caps:
            reason = unsupported_capability(cap, record.params)
            if reason:
                return pb.ValidateVolumeCapabilitiesResponse(message=reason)
        return pb.ValidateVolumeCapabilitiesResponse(
            confirmed=pb.ValidateVolumeCapabilitiesResponse.Confirmed(
                volume_context=dict(request.volume_context),
                volume_capabilities=list(request.volume_capabilities),
                parameters=dict(request.parameters),
            )
        )

    @rpc
    async def ListVolumes(
        self, request: pb.ListVolumesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListVolumesResponse:
        records, next_token = await self._volumes.page(request.starting_token, request.max_entries)
        return pb.ListVolumesResponse(
            entries=[pb.ListVolumesResponse.Entry(volume=self._volume_message(r)) for r in records],
            next_token=next_token,
        )

    @rpc
    async def GetCapacity(
        self, request: pb.GetCapacityRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCapacityResponse:
        params = parse_parameters(dict(request.parameters))
        caps = [convert.capability(c, "volume_capabilities") for c in request.volume_capabilities]
        if request.HasField("accessible_topology") and not convert.topology_allows(
            self._config, [request.accessible_topology]
        ):
            return pb.GetCapacityResponse(available_capacity=0)
        if any(unsupported_capability(cap, params) for cap in caps):
            return pb.GetCapacityResponse(available_capacity=0)
        available = self._volumes.available_bytes()
        available -= available % MIB
        return pb.GetCapacityResponse(
            available_capacity=available,
            maximum_volume_size=wrappers_pb2.Int64Value(value=available),
            minimum_volume_size=wrappers_pb2.Int64Value(value=MIB),
        )

    @rpc
    async def ControllerGetVolume(
        self, request: pb.ControllerGetVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ControllerGetVolumeResponse:
        volume_id = validate.volume_id(request.volume_id)
        record = await self._volumes.get(volume_id)
        if record is None:
            raise NotFound(f"volume {volume_id} does not exist")
        return pb.ControllerGetVolumeResponse(volume=self._volume_message(record))

    @rpc
    async def ControllerGetCapabilities(
        self, request: pb.ControllerGetCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ControllerGetCapabilitiesResponse:
        return pb.ControllerGetCapabilitiesResponse(
            capabilities=[
                pb.ControllerServiceCapability(rpc=pb.ControllerServiceCapability.RPC(type=kind))
                for kind in CAPABILITIES
            ]
        )

    # Not offered: answered UNIMPLEMENTED, and absent from the capabilities above.

    @rpc
    async def ControllerPublishVolume(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("ControllerPublishVolume is not needed: volumes are node-local (attachRequired: false)")

    @rpc
    async def ControllerUnpublishVolume(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("ControllerUnpublishVolume is not needed: volumes are node-local")

    @rpc
    async def CreateSnapshot(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("snapshots are not supported by this driver version")

    @rpc
    async def DeleteSnapshot(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("snapshots are not supported by this driver version")

    @rpc
    async def ListSnapshots(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("snapshots are not supported by this driver version")

    @rpc
    async def GetSnapshot(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("snapshots are not supported by this driver version")

    @rpc
    async def ControllerExpandVolume(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("volume expansion is not supported by this driver version")

    @rpc
    async def ControllerModifyVolume(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("volume modification is not supported by this driver version")
