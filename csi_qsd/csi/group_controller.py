"""CSI GroupController service: crash-consistent snapshots of several volumes at one instant."""

from __future__ import annotations

import grpc
from google.protobuf import timestamp_pb2

from csi_qsd import validate
from csi_qsd.controller.snapshots import Group, Snapshots
from csi_qsd.csi.controller import check_snapshot_parameters, snapshot_message
from csi_qsd.csi.errors import RpcObservers, rpc
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import InvalidArgument, NotFound

_RPC = pb.GroupControllerServiceCapability.RPC.Type


def group_message(group: Group) -> pb.VolumeGroupSnapshot:
    created = timestamp_pb2.Timestamp()
    created.FromNanoseconds(int(group.created_at * 1e9))
    return pb.VolumeGroupSnapshot(
        group_snapshot_id=group.id, snapshots=[snapshot_message(s) for s in group.members],
        creation_time=created, ready_to_use=True,
    )


def _check_members(group: Group, snapshot_ids: list[str]) -> None:
    """The spec's "snapshot list mismatch": `snapshot_ids`, when given, must be exactly the group's members."""
    if snapshot_ids and set(snapshot_ids) != {s.id for s in group.members}:
        raise InvalidArgument(f"snapshot_ids do not match the members of group snapshot {group.id}")


def _group_id(value: str) -> str:
    if not validate.GROUP_ID_RE.match(value):
        raise NotFound(f"group snapshot {value!r} does not exist")
    return value


class GroupControllerService(pb_grpc.GroupControllerServicer):
    """CSI GroupController: snapshots of several volumes cut at one instant (VolumeGroupSnapshot).

    Its own service because CSI makes it one (with its own capability); the
    cut itself is `Snapshots.create_group`', one QMP transaction over every
    member, so the group is consistent across its volumes.
    """

    def __init__(self, snapshots: Snapshots, observers: RpcObservers | None = None) -> None:
        self.rpc_observers = observers
        self._snapshots = snapshots

    @rpc
    async def GroupControllerGetCapabilities(
        self, request: pb.GroupControllerGetCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> pb.GroupControllerGetCapabilitiesResponse:
        return pb.GroupControllerGetCapabilitiesResponse(capabilities=[
            pb.GroupControllerServiceCapability(
                rpc=pb.GroupControllerServiceCapability.RPC(type=_RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT)
            )
        ])

    @rpc
    async def CreateVolumeGroupSnapshot(
        self, request: pb.CreateVolumeGroupSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateVolumeGroupSnapshotResponse:
        name = validate.name(request.name)
        check_snapshot_parameters(dict(request.parameters))
        volume_ids = [validate.volume_id(v, "source_volume_ids") for v in request.source_volume_ids]
        group = await self._snapshots.create_group(name, volume_ids)
        return pb.CreateVolumeGroupSnapshotResponse(group_snapshot=group_message(group))

    @rpc
    async def DeleteVolumeGroupSnapshot(
        self, request: pb.DeleteVolumeGroupSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteVolumeGroupSnapshotResponse:
        if validate.GROUP_ID_RE.match(request.group_snapshot_id):
            group = await self._snapshots.get_group(request.group_snapshot_id)
            if group is not None:
                _check_members(group, list(request.snapshot_ids))
                await self._snapshots.delete_group(group.id)
        return pb.DeleteVolumeGroupSnapshotResponse()

    @rpc
    async def GetVolumeGroupSnapshot(
        self, request: pb.GetVolumeGroupSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetVolumeGroupSnapshotResponse:
        group_id = _group_id(request.group_snapshot_id)
        group = await self._snapshots.get_group(group_id)
        if group is None:
            raise NotFound(f"group snapshot {group_id} does not exist")
        _check_members(group, list(request.snapshot_ids))
        return pb.GetVolumeGroupSnapshotResponse(group_snapshot=group_message(group))
