"""CSI Controller service: volume lifecycle on this node's pool.

REQUIRED fields are checked before a handler runs (`csi.required`). Each
handler then checks what the request says (names, parameters, capabilities,
paths) before it checks the IDs it names, so a malformed ID is answered like
an unknown one (NOT_FOUND) and never hides a bad field.
"""

from __future__ import annotations

import dataclasses

import grpc
from google.protobuf import timestamp_pb2, wrappers_pb2

from csi_qsd import validate
from csi_qsd.catalog import SnapshotRecord, VolumeRecord
from csi_qsd.config import TOPOLOGY_KEY_NODE, Config
from csi_qsd.controller.copy_sources import CopySources
from csi_qsd.controller.copy_targets import CopyTargets
from csi_qsd.controller.health import HealthView, VolumeHealth
from csi_qsd.controller.snapshots import Snapshots
from csi_qsd.controller.volume_limits import VolumeLimits
from csi_qsd.controller.volumes import Volumes
from csi_qsd.csi import convert
from csi_qsd.csi.errors import RpcObservers, not_offered, rpc
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unimplemented
from csi_qsd.node.copy_fill import CopyFill
from csi_qsd.params import (
    KEY_VERSION,
    MIB,
    PROVISIONER_PREFIX,
    PROVISIONER_SECRET,
    SECRET_KEY,
    key_version,
    parse_mutable_parameters,
    parse_parameters,
    unsupported_capability,
    volume_key,
    wanted_key_version,
)
from csi_qsd.sys.volume_keys import VolumeKey

_RPC = pb.ControllerServiceCapability.RPC.Type
CAPABILITIES = (
    _RPC.CREATE_DELETE_VOLUME, _RPC.LIST_VOLUMES, _RPC.GET_CAPACITY, _RPC.GET_VOLUME,
    _RPC.SINGLE_NODE_MULTI_WRITER,
    _RPC.CREATE_DELETE_SNAPSHOT, _RPC.LIST_SNAPSHOTS, _RPC.GET_SNAPSHOT, _RPC.CLONE_VOLUME,
    _RPC.LIST_VOLUMES_PUBLISHED_NODES, _RPC.VOLUME_CONDITION, _RPC.MODIFY_VOLUME,
)


def snapshot_message(record: SnapshotRecord) -> pb.Snapshot:
    created = timestamp_pb2.Timestamp()
    created.FromNanoseconds(int(record.created_at * 1e9))
    return pb.Snapshot(
        snapshot_id=record.id, source_volume_id=record.source_volume_id, size_bytes=record.size,
        creation_time=created, ready_to_use=True, group_snapshot_id=record.group_id,
    )


def check_snapshot_parameters(parameters: dict[str, str]) -> None:
    unknown = sorted(k for k in parameters if not k.startswith(PROVISIONER_PREFIX))
    if unknown:
        raise InvalidArgument(f"unknown snapshot parameter {unknown[0]!r}: snapshots take no parameters")


@dataclasses.dataclass(frozen=True)
class CopyEnds:
    """Both ends of copies across nodes, for the CSI layer: the target's creates and fills, the source's leases.

    Bundled here, above both: the creates and leases are the controller side's, the fills the node side's, and
    neither side imports the other.
    """

    targets: CopyTargets
    sources: CopySources
    fill: CopyFill

    def lost(self, volume_id: str) -> bool:
        """True if the volume's copy can never be finished (its source dropped the lease)."""
        return self.fill.lost(volume_id)

    def condition(self, volume_id: str) -> tuple[bool, str] | None:
        """(abnormal, message) while the volume is still being made local; None once it is."""
        status = self.fill.status(volume_id)
        if status is None:
            return None
        if status.problem:
            return True, f"volume {volume_id}: {status.problem}"
        done = f"{status.done * 100 // status.total}%" if status.total else "starting"
        return False, f"volume {volume_id} is usable and being copied from node {status.node} ({done})"


class ControllerService(pb_grpc.ControllerServicer):
    """CSI Controller: create, delete, snapshot, list, expand and modify volumes, on the node that holds them.

    Volumes are node-local, so the controller runs in each node plugin and
    answers for that node only. Each handler checks the request, calls the
    domain (`csi_qsd.controller`, and the copy ends for a source on another
    node) and builds the response; `errors.rpc` turns domain errors into
    status codes.
    """

    def __init__(
        self, config: Config, volumes: Volumes, snapshots: Snapshots, health: HealthView, limits: VolumeLimits,
        observers: RpcObservers | None = None, copies: CopyEnds | None = None,
    ) -> None:
        self.rpc_observers = observers
        self._copies = copies
        self._config = config
        self._volumes = volumes
        self._snapshots = snapshots
        self._health = health
        self._limits = limits

    def _published_nodes(self, health: VolumeHealth) -> list[str]:
        """Volumes are node-local: published anywhere means published on this node."""
        return [self._config.node_id] if health.published else []

    def _volume_message(self, record: VolumeRecord) -> pb.Volume:
        kind, _, source_id = record.source.partition(":")
        content = None
        if kind == "snapshot":
            content = pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=source_id))
        elif kind == "volume":
            content = pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(volume_id=source_id))
        return pb.Volume(
            content_source=content,
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
        qos = parse_mutable_parameters(dict(request.mutable_parameters))
        source = request.volume_content_source if request.HasField("volume_content_source") else None
        if request.HasField("accessibility_requirements"):
            requisite = list(request.accessibility_requirements.requisite)
            if requisite and not convert.topology_allows(self._config, requisite):
                raise ResourceExhausted(
                    f"volume {name!r} cannot be placed: requisite topology excludes node {self._config.node_id!r}"
                )
        required, limit = request.capacity_range.required_bytes, request.capacity_range.limit_bytes
        key = volume_key(dict(request.secrets), f"volume {name!r}", PROVISIONER_SECRET) if params.encrypted else None
        version = _first_key_version(dict(request.secrets), dict(request.mutable_parameters), params.encrypted)
        if source is None:
            record = await self._volumes.create(name, required, limit, params, caps, qos=qos, key=key, key_version=version)
        elif source.WhichOneof("type") == "snapshot":
            snapshot_id = validate.snapshot_id(source.snapshot.snapshot_id, "volume_content_source.snapshot.snapshot_id")
            if self._copies is not None and self._config.copies_with_peers and await self._snapshots.get(snapshot_id) is None:
                record = await self._copies.targets.create(
                    name, required, limit, params, caps, source=f"snapshot:{snapshot_id}", qos=qos, key=key,
                    key_version=version)
            else:
                record = await self._snapshots.volume_from(
                    name, required, limit, params, caps, snapshot_id=snapshot_id, qos=qos, key=key, key_version=version)
        else:
            volume_id = validate.volume_id(source.volume.volume_id, "volume_content_source.volume.volume_id")
            if self._copies is not None and self._config.copies_with_peers and await self._volumes.get(volume_id) is None:
                record = await self._copies.targets.create(
                    name, required, limit, params, caps, source=f"volume:{volume_id}", qos=qos, key=key,
                    key_version=version)
            else:
                record = await self._snapshots.volume_from(
                    name, required, limit, params, caps, volume_id=volume_id, qos=qos, key=key, key_version=version)
        return pb.CreateVolumeResponse(volume=self._volume_message(record))

    @rpc
    async def DeleteVolume(
        self, request: pb.DeleteVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteVolumeResponse:
        if validate.VOLUME_ID_RE.match(request.volume_id):
            if self._copies is None:
                await self._volumes.delete(request.volume_id)
            else:
                await self._delete_copied(request.volume_id, self._copies)
        return pb.DeleteVolumeResponse()

    async def _delete_copied(self, volume_id: str, copies: CopyEnds) -> None:
        """DeleteVolume where volumes cross nodes: refused while a copy elsewhere reads it; its own copy stops."""
        await copies.sources.refuse_volume_delete(volume_id)
        stopped = await copies.fill.stop(volume_id)
        try:
            await self._volumes.delete(volume_id)
        except BaseException:
            if stopped:
                copies.fill.start(volume_id)
            raise
        await copies.targets.release_later(volume_id)

    @rpc
    async def ValidateVolumeCapabilities(
        self, request: pb.ValidateVolumeCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ValidateVolumeCapabilitiesResponse:
        volume_id = validate.volume_id(request.volume_id)
        record = await self._volumes.get(volume_id)
        if record is None:
            raise NotFound(f"volume {volume_id} does not exist")
        caps = convert.capabilities(list(request.volume_capabilities))
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
        health = await self._health.of(records)
        return pb.ListVolumesResponse(
            entries=[
                pb.ListVolumesResponse.Entry(
                    volume=self._volume_message(r),
                    status=pb.ListVolumesResponse.VolumeStatus(
                        published_node_ids=self._published_nodes(health[r.id]),
                        volume_condition=self._condition(r.id, health[r.id]),
                    ),
                )
                for r in records
            ],
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
        # Per pool (parameter `pool`): a device pool's largest volume is its largest free extent.
        available = self._volumes.available_bytes(params.pool)
        available -= available % MIB
        largest = min(self._volumes.largest_volume(params.pool), available)
        largest -= largest % MIB
        return pb.GetCapacityResponse(
            available_capacity=available,
            maximum_volume_size=wrappers_pb2.Int64Value(value=largest),
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
        health = (await self._health.of([record]))[record.id]
        return pb.ControllerGetVolumeResponse(
            volume=self._volume_message(record),
            status=pb.ControllerGetVolumeResponse.VolumeStatus(
                published_node_ids=self._published_nodes(health),
                volume_condition=self._condition(record.id, health),
            ),
        )

    def _condition(self, volume_id: str, health: VolumeHealth) -> pb.VolumeCondition:
        """The volume's condition; one still being copied from another node says how far, or why it stopped
        (a copy that is lost for good says so before anything else)."""
        copying = self._copies.condition(volume_id) if self._copies is not None else None
        if copying is not None and (not health.abnormal or self._copies is not None and self._copies.lost(volume_id)):
            return pb.VolumeCondition(abnormal=copying[0], message=copying[1])
        return pb.VolumeCondition(abnormal=health.abnormal, message=health.message)

    @rpc
    async def ControllerModifyVolume(
        self, request: pb.ControllerModifyVolumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ControllerModifyVolumeResponse:
        """Change a volume's I/O limits or rotate its key (a VolumeAttributesClass), live where it is staged.

        The keys are checked once the volume is known (`limits.modify`), so an
        unknown volume is NOT_FOUND whatever they hold; none is nothing to change.
        A `keyVersion` takes its keys from `secrets` (the Secret named by
        `csi.storage.k8s.io/controller-modify-secret-name`).
        """
        volume_id = validate.volume_id(request.volume_id)
        await self._limits.modify(volume_id, dict(request.mutable_parameters), dict(request.secrets))
        return pb.ControllerModifyVolumeResponse()

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

    @rpc
    async def CreateSnapshot(
        self, request: pb.CreateSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateSnapshotResponse:
        name = validate.name(request.name)
        check_snapshot_parameters(dict(request.parameters))
        source = validate.volume_id(request.source_volume_id, "source_volume_id")
        given = request.secrets.get(SECRET_KEY, "")
        record = await self._snapshots.create(name, source, VolumeKey(given) if given else None)
        return pb.CreateSnapshotResponse(snapshot=snapshot_message(record))

    @rpc
    async def DeleteSnapshot(
        self, request: pb.DeleteSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteSnapshotResponse:
        if validate.SNAPSHOT_ID_RE.match(request.snapshot_id):
            await self._snapshots.delete(request.snapshot_id)
        return pb.DeleteSnapshotResponse()

    @rpc
    async def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        records, token = await self._snapshots.page(
            request.starting_token, request.max_entries,
            snapshot_id=request.snapshot_id, source_volume_id=request.source_volume_id,
        )
        return pb.ListSnapshotsResponse(
            entries=[pb.ListSnapshotsResponse.Entry(snapshot=snapshot_message(r)) for r in records], next_token=token,
        )

    @rpc
    async def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetSnapshotResponse:
        snapshot_id = validate.snapshot_id(request.snapshot_id)
        record = await self._snapshots.get(snapshot_id)
        if record is None:
            raise NotFound(f"snapshot {snapshot_id} does not exist")
        return pb.GetSnapshotResponse(snapshot=snapshot_message(record))

    # Not offered: answered UNIMPLEMENTED whatever the request holds, and absent from the capabilities above.

    @not_offered
    async def ControllerPublishVolume(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("ControllerPublishVolume is not needed: volumes are node-local (attachRequired: false)")

    @not_offered
    async def ControllerUnpublishVolume(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("ControllerUnpublishVolume is not needed: volumes are node-local")

    @not_offered
    async def ControllerExpandVolume(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise Unimplemented("volume expansion is not supported by this driver version")


def _first_key_version(secrets: dict[str, str], mutable: dict[str, str], encrypted: bool) -> str:
    """The key version a new volume is made with: the provisioner Secret's `keyVersion` ('' if none).

    A VolumeAttributesClass that names a version (the class a rotation moves
    claims to) must name that one. Raises InvalidArgument, FailedPrecondition.
    """
    wanted = wanted_key_version(mutable)
    if not encrypted:
        if wanted is not None:
            raise InvalidArgument(f"mutable parameter {KEY_VERSION!r} applies only to encrypted volumes")
        return ""
    version = key_version(secrets, PROVISIONER_SECRET)
    if wanted is not None and wanted != version:
        raise FailedPrecondition(f"the VolumeAttributesClass asks for key version {wanted!r}, and entry "
                                 f"{KEY_VERSION!r} of the Secret named by {PROVISIONER_SECRET!r} says "
                                 f"{version or 'nothing'!r}")
    return version
