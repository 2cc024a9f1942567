"""CSI Identity service: who the plugin is, what it offers, whether it is ready."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf import wrappers_pb2

from csi_qsd import __version__
from csi_qsd.csi.errors import RpcObservers, rpc
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc

_Service = pb.PluginCapability.Service
_Expansion = pb.PluginCapability.VolumeExpansion


class IdentityService(pb_grpc.IdentityServicer):
    def __init__(
        self, driver_name: str, ready: Callable[[], bool], online_expansion: Callable[[], bool] = lambda: True,
        observers: RpcObservers | None = None,
    ) -> None:
        self.rpc_observers = observers
        self._driver_name = driver_name
        self._ready = ready
        self._online_expansion = online_expansion

    @rpc
    async def GetPluginInfo(
        self, request: pb.GetPluginInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=self._driver_name, vendor_version=__version__)

    @rpc
    async def GetPluginCapabilities(
        self, request: pb.GetPluginCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPluginCapabilitiesResponse:
        services = (
            _Service.CONTROLLER_SERVICE, _Service.VOLUME_ACCESSIBILITY_CONSTRAINTS, _Service.GROUP_CONTROLLER_SERVICE,
            _Service.SNAPSHOT_METADATA_SERVICE,
        )
        # ONLINE where a running VM sees its vhost-user-blk disk grow (QSD >= 10); QSD 7.2 never tells
        # the guest, so there Kubernetes expands only volumes no pod uses. NodeExpandVolume does the work.
        mode = _Expansion.ONLINE if self._online_expansion() else _Expansion.OFFLINE
        expansion = pb.PluginCapability(volume_expansion=pb.PluginCapability.VolumeExpansion(type=mode))
        return pb.GetPluginCapabilitiesResponse(
            capabilities=[pb.PluginCapability(service=_Service(type=kind)) for kind in services] + [expansion]
        )

    @rpc
    async def Probe(self, request: pb.ProbeRequest, context: grpc.aio.ServicerContext) -> pb.ProbeResponse:
        return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=self._ready()))
