"""CSI Node service: stage, publish and report volumes on this node.

REQUIRED fields are checked before a handler runs (`csi.required`). Each
handler then looks the volume up, a malformed ID answered like an unknown
one (NOT_FOUND), and only then checks what the request holds: the paths and
the capability (INVALID_ARGUMENT). So an unknown volume is NOT_FOUND however
its paths read, as the spec's tables and csi-sanity expect; the domain call
that follows looks the volume up again under its lock.
"""

from __future__ import annotations

import grpc

from csi_qsd import validate
from csi_qsd.config import TOPOLOGY_KEY_FUSE, TOPOLOGY_KEY_NODE, TOPOLOGY_KEY_VHOST_USER, Config
from csi_qsd.csi import convert
from csi_qsd.csi.errors import RpcObservers, rpc
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import InvalidArgument, NotFound
from csi_qsd.node.staging import PublishSpec, StageSpec, Staging
from csi_qsd.params import NODE_STAGE_SECRET, AccessMode, previous_key, unsupported_capability, volume_key

_RPC = pb.NodeServiceCapability.RPC.Type
CAPABILITIES = (
    _RPC.STAGE_UNSTAGE_VOLUME, _RPC.GET_VOLUME_STATS, _RPC.VOLUME_CONDITION,
    _RPC.SINGLE_NODE_MULTI_WRITER, _RPC.VOLUME_MOUNT_GROUP, _RPC.EXPAND_VOLUME,
)


class NodeService(pb_grpc.NodeServicer):
    def __init__(
        self, config: Config, node: Staging, features: dict[str, bool], observers: RpcObservers | None = None,
    ) -> None:
        self.rpc_observers = observers
        self._config = config
        self._node = node
        self._features = features

    def _capability(
        self, request: pb.NodeStageVolumeRequest | pb.NodePublishVolumeRequest,
    ) -> tuple[bool, str, tuple[str, ...], str, bool]:
        """(block, fs_type, mount flags, mount group, single writer) of the request's capability."""
        cap = convert.capability(request.volume_capability)
        reason = unsupported_capability(cap, None)
        if reason:
            raise InvalidArgument(reason)
        mount = request.volume_capability.mount
        flags = tuple(validate.mount_flags(list(mount.mount_flags))) if not cap.block else ()
        group = convert.mount_group(mount.volume_mount_group) if not cap.block else ""
        return cap.block, cap.fs_type, flags, group, cap.mode is AccessMode.SINGLE_NODE_SINGLE_WRITER

    async def _known(self, value: str, *, any_state: bool = False) -> str:
        """The request's volume ID once the volume is known to exist; NotFound otherwise."""
        volume_id = validate.volume_id(value)
        await self._node.volume(volume_id, any_state=any_state)
        return volume_id

    @rpc
    async def NodeStageVolume(
        self, request: pb.NodeStageVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeStageVolumeResponse:
        volume_id = await self._known(request.volume_id)
        staging = convert.request_path(request.staging_target_path, "staging_target_path", self._config)
        block, fs_type, flags, group, _single = self._capability(request)
        volume = await self._node.volume(volume_id)
        secrets = dict(request.secrets)
        key = volume_key(secrets, f"volume {volume_id}", NODE_STAGE_SECRET) if volume.params.encrypted else None
        await self._node.stage(StageSpec(volume_id, staging, block, fs_type, flags, group, key, previous_key(secrets)))
        return pb.NodeStageVolumeResponse()

    @rpc
    async def NodeUnstageVolume(
        self, request: pb.NodeUnstageVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeUnstageVolumeResponse:
        volume_id = await self._known(request.volume_id, any_state=True)
        staging = convert.request_path(request.staging_target_path, "staging_target_path", self._config)
        await self._node.unstage(volume_id, staging)
        return pb.NodeUnstageVolumeResponse()

    @rpc
    async def NodePublishVolume(
        self, request: pb.NodePublishVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodePublishVolumeResponse:
        volume_id = await self._known(request.volume_id)
        staging = convert.request_path(request.staging_target_path, "staging_target_path", self._config)
        target = convert.request_path(request.target_path, "target_path", self._config)
        if target == staging:
            raise InvalidArgument("target_path must differ from staging_target_path")
        if staging in target.parents or target in staging.parents:
            raise InvalidArgument(
                f"target_path {str(target)!r} and staging_target_path {str(staging)!r} must not contain each other"
            )
        block, _fs_type, flags, group, single_writer = self._capability(request)
        await self._node.publish(
            PublishSpec(volume_id, staging, target, block, request.readonly, flags, group, single_writer))
        return pb.NodePublishVolumeResponse()

    @rpc
    async def NodeUnpublishVolume(
        self, request: pb.NodeUnpublishVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeUnpublishVolumeResponse:
        volume_id = await self._known(request.volume_id, any_state=True)
        target = convert.request_path(request.target_path, "target_path", self._config)
        await self._node.unpublish(volume_id, target)
        return pb.NodeUnpublishVolumeResponse()

    @rpc
    async def NodeGetVolumeStats(
        self, request: pb.NodeGetVolumeStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeGetVolumeStatsResponse:
        volume_id = await self._known(request.volume_id)
        try:
            path = convert.request_path(request.volume_path, "volume_path", self._config)
        except InvalidArgument as exc:
            # The spec's only NodeGetVolumeStats error: the volume does not exist at volume_path.
            # A path that could never hold a volume of ours holds this one nowhere (csi-sanity
            # asks with "some/path"); stats only read, so nothing is touched at such a path.
            raise NotFound(f"volume {volume_id} is not staged or published at volume_path: {exc}") from None
        stats = await self._node.stats(volume_id, path)
        usage = [pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=stats.total_bytes,
                                available=stats.available_bytes, used=stats.used_bytes)]
        if not stats.block:
            usage.append(pb.VolumeUsage(unit=pb.VolumeUsage.INODES, total=stats.total_inodes,
                                        available=stats.available_inodes, used=stats.used_inodes))
        return pb.NodeGetVolumeStatsResponse(
            usage=usage, volume_condition=pb.VolumeCondition(abnormal=stats.abnormal, message=stats.message)
        )

    @rpc
    async def NodeExpandVolume(
        self, request: pb.NodeExpandVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeExpandVolumeResponse:
        volume_id = await self._known(request.volume_id)
        path = convert.request_path(request.volume_path, "volume_path", self._config)
        if request.HasField("volume_capability"):
            convert.capability(request.volume_capability)
        size = await self._node.expand(
            volume_id, path, request.capacity_range.required_bytes, request.capacity_range.limit_bytes
        )
        return pb.NodeExpandVolumeResponse(capacity_bytes=size)

    @rpc
    async def NodeGetCapabilities(
        self, request: pb.NodeGetCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeGetCapabilitiesResponse:
        return pb.NodeGetCapabilitiesResponse(
            capabilities=[pb.NodeServiceCapability(rpc=pb.NodeServiceCapability.RPC(type=kind))
                          for kind in CAPABILITIES]
        )

    @rpc
    async def NodeGetInfo(
        self, request: pb.NodeGetInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeGetInfoResponse:
        segments = {TOPOLOGY_KEY_NODE: self._config.node_id}
        if self._features.get("fuse"):
            segments[TOPOLOGY_KEY_FUSE] = "true"
        if self._features.get("vhost-user-blk"):
            segments[TOPOLOGY_KEY_VHOST_USER] = "true"
        return pb.NodeGetInfoResponse(
            node_id=self._config.node_id, max_volumes_per_node=self._config.max_volumes,
            accessible_topology=pb.Topology(segments=segments),
        )
