"""A small CSI client for people: the calls a provisioner and kubelet would make.

Used by `csi-qsd volume …` so a newcomer can drive a served driver without a
cluster, and by tests that run the driver as a separate process.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.transport.copy_peers import LEASES_SERVICE

SINGLE_NODE_WRITER = pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER


def capability(*, block: bool = False, fs_type: str = "", mount_flags: tuple[str, ...] = (),
               mount_group: str = "", mode: int = SINGLE_NODE_WRITER) -> pb.VolumeCapability:
    access = pb.VolumeCapability.AccessMode(mode=mode)  # type: ignore[arg-type]
    if block:
        return pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(), access_mode=access)
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type=fs_type, mount_flags=list(mount_flags),
                                              volume_mount_group=mount_group),
        access_mode=access,
    )


class CSIClient:
    """Async stubs for the three CSI services on one endpoint."""

    def __init__(self, endpoint: str, timeout: float = 120.0) -> None:
        self._channel = grpc.aio.insecure_channel(endpoint)
        self.identity = pb_grpc.IdentityStub(self._channel)
        self.controller = pb_grpc.ControllerStub(self._channel)
        self.node = pb_grpc.NodeStub(self._channel)
        self.group = pb_grpc.GroupControllerStub(self._channel)
        self.metadata = pb_grpc.SnapshotMetadataStub(self._channel)
        self.timeout = timeout

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "CSIClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create_volume(self, name: str, size: int, parameters: dict[str, str] | None = None,
                            *, block: bool = False, fs_type: str = "", from_snapshot: str = "",
                            from_volume: str = "", secrets: dict[str, str] | None = None) -> pb.Volume:
        source = None
        if from_snapshot:
            source = pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=from_snapshot))
        elif from_volume:
            source = pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(volume_id=from_volume))
        response: Any = await self.controller.CreateVolume(
            pb.CreateVolumeRequest(
                name=name, capacity_range=pb.CapacityRange(required_bytes=size),
                volume_capabilities=[capability(block=block, fs_type=fs_type)],
                parameters=parameters or {}, volume_content_source=source, secrets=secrets or {},
            ),
            timeout=self.timeout,
        )
        return response.volume  # type: ignore[no-any-return]

    async def delete_volume(self, volume_id: str) -> None:
        await self.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume_id), timeout=self.timeout)

    async def create_snapshot(self, name: str, volume_id: str, secrets: dict[str, str] | None = None) -> pb.Snapshot:
        response: Any = await self.controller.CreateSnapshot(
            pb.CreateSnapshotRequest(name=name, source_volume_id=volume_id, secrets=secrets or {}), timeout=self.timeout
        )
        return response.snapshot  # type: ignore[no-any-return]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snapshot_id), timeout=self.timeout)

    async def list_snapshots(self, *, source_volume_id: str = "", snapshot_id: str = "") -> list[pb.Snapshot]:
        snapshots: list[pb.Snapshot] = []
        token = ""
        while True:
            page: Any = await self.controller.ListSnapshots(
                pb.ListSnapshotsRequest(max_entries=100, starting_token=token, source_volume_id=source_volume_id,
                                        snapshot_id=snapshot_id),
                timeout=self.timeout,
            )
            snapshots.extend(entry.snapshot for entry in page.entries)
            token = page.next_token
            if not token:
                return snapshots

    async def create_group_snapshot(self, name: str, volume_ids: list[str]) -> pb.VolumeGroupSnapshot:
        response: Any = await self.group.CreateVolumeGroupSnapshot(
            pb.CreateVolumeGroupSnapshotRequest(name=name, source_volume_ids=volume_ids), timeout=self.timeout
        )
        return response.group_snapshot  # type: ignore[no-any-return]

    async def list_volumes(self) -> list[pb.Volume]:
        return [entry.volume for entry in await self.list_volume_entries()]

    async def list_volume_entries(self) -> list[pb.ListVolumesResponse.Entry]:
        """Every page of ListVolumes: each volume with its status (published nodes, condition)."""
        entries: list[pb.ListVolumesResponse.Entry] = []
        token = ""
        while True:
            page = await self.controller.ListVolumes(
                pb.ListVolumesRequest(max_entries=100, starting_token=token), timeout=self.timeout
            )
            entries.extend(page.entries)
            token = page.next_token
            if not token:
                return entries

    async def modify(self, volume_id: str, mutable: dict[str, str], secrets: dict[str, str] | None = None) -> None:
        """ControllerModifyVolume: I/O limits, or a key rotation (`keyVersion`, keys in `secrets`)."""
        await self.controller.ControllerModifyVolume(
            pb.ControllerModifyVolumeRequest(volume_id=volume_id, mutable_parameters=mutable, secrets=secrets or {}),
            timeout=self.timeout)

    async def stage(self, volume_id: str, staging_path: str, *, block: bool = False, fs_type: str = "",
                    mount_group: str = "", secrets: dict[str, str] | None = None) -> None:
        await self.node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=volume_id, staging_target_path=staging_path,
                volume_capability=capability(block=block, fs_type=fs_type, mount_group=mount_group),
                secrets=secrets or {},
            ),
            timeout=self.timeout,
        )

    async def unstage(self, volume_id: str, staging_path: str) -> None:
        await self.node.NodeUnstageVolume(
            pb.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=staging_path),
            timeout=self.timeout,
        )

    async def publish(self, volume_id: str, staging_path: str, target_path: str, *, block: bool = False,
                      fs_type: str = "", readonly: bool = False, mount_group: str = "",
                      mode: int = SINGLE_NODE_WRITER) -> None:
        await self.node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=volume_id, staging_target_path=staging_path, target_path=target_path,
                volume_capability=capability(block=block, fs_type=fs_type, mount_group=mount_group, mode=mode),
                readonly=readonly,
            ),
            timeout=self.timeout,
        )

    async def unpublish(self, volume_id: str, target_path: str) -> None:
        await self.node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target_path), timeout=self.timeout
        )

    async def stats(self, volume_id: str, path: str) -> pb.NodeGetVolumeStatsResponse:
        response: Any = await self.node.NodeGetVolumeStats(
            pb.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=path), timeout=self.timeout
        )
        return response  # type: ignore[no-any-return]

    async def expand(self, volume_id: str, path: str, size: int) -> int:
        response: Any = await self.node.NodeExpandVolume(
            pb.NodeExpandVolumeRequest(volume_id=volume_id, volume_path=path,
                                       capacity_range=pb.CapacityRange(required_bytes=size)),
            timeout=self.timeout,
        )
        return int(response.capacity_bytes)

    async def metadata_allocated(self, snapshot_id: str, *, starting_offset: int = 0,
                                 max_results: int = 0) -> tuple[int, list[tuple[int, int]]]:
        """GetMetadataAllocated, every message read: (volume capacity, [(offset, length), ...])."""
        return await _ranges(self.metadata.GetMetadataAllocated(pb.GetMetadataAllocatedRequest(
            snapshot_id=snapshot_id, starting_offset=starting_offset, max_results=max_results), timeout=self.timeout))

    async def metadata_delta(self, base_snapshot_id: str, target_snapshot_id: str, *, starting_offset: int = 0,
                             max_results: int = 0) -> tuple[int, list[tuple[int, int]]]:
        """GetMetadataDelta, every message read: (volume capacity, [(offset, length), ...])."""
        return await _ranges(self.metadata.GetMetadataDelta(pb.GetMetadataDeltaRequest(
            base_snapshot_id=base_snapshot_id, target_snapshot_id=target_snapshot_id,
            starting_offset=starting_offset, max_results=max_results), timeout=self.timeout))

    async def capacity(self) -> int:
        response = await self.controller.GetCapacity(pb.GetCapacityRequest(), timeout=self.timeout)
        return int(response.available_capacity)

    async def plugin_info(self) -> pb.GetPluginInfoResponse:
        response: Any = await self.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=self.timeout)
        return response  # type: ignore[no-any-return]

    async def copy_leases(self) -> list[dict[str, Any]]:
        """The leases the driver serves to copies on other nodes (`csi_qsd.v1.CopyLeases/List`)."""
        answer = await self._json("List", {})
        leases: list[dict[str, Any]] = answer.get("leases", [])
        return leases

    async def drop_copy_lease(self, copy_volume_id: str) -> dict[str, Any]:
        """Drop the lease of copy `copy_volume_id` (`csi_qsd.v1.CopyLeases/Drop`): what it names."""
        return await self._json("Drop", {"copy_volume_id": copy_volume_id})

    async def lift_copy_lease_drop(self, copy_volume_id: str) -> dict[str, Any]:
        """Let the copy whose lease was dropped be leased again (`csi_qsd.v1.CopyLeases/Lift`): what it names."""
        return await self._json("Lift", {"copy_volume_id": copy_volume_id})

    async def _json(self, method: str, request: dict[str, Any]) -> dict[str, Any]:
        call = self._channel.unary_unary(f"/{LEASES_SERVICE}/{method}",
                                         request_serializer=lambda m: json.dumps(m).encode(),
                                         response_deserializer=json.loads)
        answer: dict[str, Any] = await call(request, timeout=self.timeout)
        return answer

    async def probe(self) -> bool:
        """Whether the plugin says it is ready; a Probe answer without `ready` means ready, as the spec says."""
        response = await self.identity.Probe(pb.ProbeRequest(), timeout=self.timeout)
        return not response.HasField("ready") or bool(response.ready.value)



async def _ranges(call: Any) -> tuple[int, list[tuple[int, int]]]:
    capacity = 0
    ranges: list[tuple[int, int]] = []
    async for message in call:
        capacity = int(message.volume_capacity_bytes)
        ranges.extend((int(m.byte_offset), int(m.size_bytes)) for m in message.block_metadata)
    return capacity, ranges
