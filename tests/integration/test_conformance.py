"""Every RPC × every REQUIRED field × (known, unknown, malformed ID): a missing field is INVALID_ARGUMENT.

The CSI spec's error scheme answers "missing required field" with
INVALID_ARGUMENT, and nothing in a request may outrank it: not an unknown
volume ID (NOT_FOUND), not a malformed one. Each row below is written from
the spec's message definitions (CSI v1.12.0), independently of the driver's
own table, and drives the real driver: a complete request for the RPC is
built with the IDs of objects that exist, IDs the driver could have issued
but did not, or IDs it could never issue; then one REQUIRED field is
cleared, and the answer must carry the spec's code and name the field.

Two rows differ by the spec: NodePublishVolume without `staging_target_path`
is FAILED_PRECONDITION (its table, since STAGE_UNSTAGE_VOLUME is advertised),
and an RPC the driver does not offer is UNIMPLEMENTED whatever it lacks.
A baseline per RPC sends the complete request with unknown IDs, so a
template that was itself incomplete would fail there and not hide here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from csi_qsd.cli.client import CSIClient, capability
from csi_qsd.csi_pb import csi_pb2 as pb
from testing.harness import Sandbox

MIB = 1 << 20
Code = grpc.StatusCode
VARIANTS = ("known", "unknown", "malformed")
UNKNOWN = {"volume": "vol-" + "0" * 24, "snapshot": "snap-" + "0" * 24, "group": "group-" + "0" * 24}
MALFORMED = {"volume": "../../etc/passwd", "snapshot": "snap-\x00/..", "group": "group/../x"}
OTHER = "snap-" + "1" * 24  # a snapshot ID that is no member of any group


@dataclasses.dataclass
class Objects:
    """IDs of one variant for every kind of object a request can name."""

    volume: str
    snapshot: str
    group: str
    group_members: list[str]


@dataclasses.dataclass(frozen=True)
class Row:
    """One RPC: how to call it, a complete request, its REQUIRED fields and what a complete one answers."""

    method: str
    service: str
    build: Callable[[Objects, Sandbox], Message]
    required: tuple[str, ...]           # dotted paths, in the spec's order; "[0]" indexes a repeated field
    unknown_answer: Code | None = Code.NOT_FOUND  # the complete request with unknown IDs (None: OK)
    offered: bool = True
    codes: dict[str, Code] = dataclasses.field(default_factory=dict)  # field → code other than INVALID_ARGUMENT
    id_kinds: tuple[str, ...] = ("volume",)  # which objects the request names (for the variants that matter)
    empty_ok: tuple[str, ...] = ()  # maps and lists a CO may send empty: the request stands without them
    malformed: dict[str, Any] = dataclasses.field(default_factory=dict)  # field → a present but malformed value
    malformed_known: Code = Code.INVALID_ARGUMENT  # what a malformed value answers once the IDs are known


def cap(block: bool = False) -> pb.VolumeCapability:
    return capability(block=block)


def staging(box: Sandbox) -> str:
    return str(box.kubelet / "plugins" / "staging" / "c")


def target(box: Sandbox) -> str:
    return str(box.kubelet / "pods" / "c" / "volume")


ROWS = [
    Row("CreateVolume", "controller", lambda o, b: pb.CreateVolumeRequest(
        name="pvc-conformance", capacity_range=pb.CapacityRange(required_bytes=16 * MIB), volume_capabilities=[cap()],
        volume_content_source=pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(
            snapshot_id=o.snapshot))),
        ("name", "volume_capabilities", "volume_capabilities[0].access_type", "volume_capabilities[0].access_mode",
         "volume_content_source.type", "volume_content_source.snapshot.snapshot_id"),
        id_kinds=("snapshot",)),
    Row("DeleteVolume", "controller", lambda o, b: pb.DeleteVolumeRequest(volume_id=o.volume), ("volume_id",),
        unknown_answer=None),
    Row("ControllerPublishVolume", "controller", lambda o, b: pb.ControllerPublishVolumeRequest(
        volume_id=o.volume, node_id="node-a", volume_capability=cap()),
        ("volume_id", "node_id", "volume_capability"), unknown_answer=Code.UNIMPLEMENTED, offered=False),
    Row("ControllerUnpublishVolume", "controller", lambda o, b: pb.ControllerUnpublishVolumeRequest(
        volume_id=o.volume), ("volume_id",), unknown_answer=Code.UNIMPLEMENTED, offered=False),
    Row("ValidateVolumeCapabilities", "controller", lambda o, b: pb.ValidateVolumeCapabilitiesRequest(
        volume_id=o.volume, volume_capabilities=[cap()]),
        ("volume_id", "volume_capabilities", "volume_capabilities[0].access_mode")),
    Row("ControllerGetVolume", "controller", lambda o, b: pb.ControllerGetVolumeRequest(volume_id=o.volume),
        ("volume_id",)),
    Row("ControllerModifyVolume", "controller", lambda o, b: pb.ControllerModifyVolumeRequest(
        volume_id=o.volume, mutable_parameters={"iopsTotal": "100"}), ("volume_id",),
        empty_ok=("mutable_parameters",), malformed={"mutable_parameters": {"noSuchLimit": "1"}}),
    Row("GetCapacity", "controller", lambda o, b: pb.GetCapacityRequest(volume_capabilities=[cap()]),
        ("volume_capabilities[0].access_type", "volume_capabilities[0].access_mode"), unknown_answer=None,
        id_kinds=()),
    Row("CreateSnapshot", "controller", lambda o, b: pb.CreateSnapshotRequest(
        source_volume_id=o.volume, name="snap-conformance"), ("source_volume_id", "name")),
    Row("DeleteSnapshot", "controller", lambda o, b: pb.DeleteSnapshotRequest(snapshot_id=o.snapshot),
        ("snapshot_id",), unknown_answer=None, id_kinds=("snapshot",)),
    Row("GetSnapshot", "controller", lambda o, b: pb.GetSnapshotRequest(snapshot_id=o.snapshot), ("snapshot_id",),
        id_kinds=("snapshot",)),
    Row("ControllerExpandVolume", "controller", lambda o, b: pb.ControllerExpandVolumeRequest(
        volume_id=o.volume, capacity_range=pb.CapacityRange(required_bytes=32 * MIB), volume_capability=cap()),
        ("volume_id", "capacity_range", "volume_capability.access_mode"), unknown_answer=Code.UNIMPLEMENTED,
        offered=False),
    Row("NodeStageVolume", "node", lambda o, b: pb.NodeStageVolumeRequest(
        volume_id=o.volume, staging_target_path=staging(b), volume_capability=cap()),
        ("volume_id", "staging_target_path", "volume_capability", "volume_capability.access_type",
         "volume_capability.access_mode"), malformed={"staging_target_path": "some/path"}),
    Row("NodeUnstageVolume", "node", lambda o, b: pb.NodeUnstageVolumeRequest(
        volume_id=o.volume, staging_target_path=staging(b)), ("volume_id", "staging_target_path"),
        malformed={"staging_target_path": "some/path"}),
    Row("NodePublishVolume", "node", lambda o, b: pb.NodePublishVolumeRequest(
        volume_id=o.volume, staging_target_path=staging(b), target_path=target(b), volume_capability=cap()),
        ("volume_id", "target_path", "volume_capability", "volume_capability.access_mode", "staging_target_path"),
        codes={"staging_target_path": Code.FAILED_PRECONDITION}, malformed={"target_path": "some/path"}),
    Row("NodeUnpublishVolume", "node", lambda o, b: pb.NodeUnpublishVolumeRequest(
        volume_id=o.volume, target_path=target(b)), ("volume_id", "target_path"),
        malformed={"target_path": "some/path"}),
    Row("NodeGetVolumeStats", "node", lambda o, b: pb.NodeGetVolumeStatsRequest(
        volume_id=o.volume, volume_path=staging(b)), ("volume_id", "volume_path"),
        malformed={"volume_path": "some/path"}, malformed_known=Code.NOT_FOUND),
    Row("NodeExpandVolume", "node", lambda o, b: pb.NodeExpandVolumeRequest(
        volume_id=o.volume, volume_path=staging(b), capacity_range=pb.CapacityRange(required_bytes=32 * MIB),
        volume_capability=cap()),
        ("volume_id", "volume_path", "volume_capability.access_type", "volume_capability.access_mode"),
        malformed={"volume_path": "some/path"}),
    Row("CreateVolumeGroupSnapshot", "group", lambda o, b: pb.CreateVolumeGroupSnapshotRequest(
        name="group-conformance", source_volume_ids=[o.volume]), ("name", "source_volume_ids")),
    Row("DeleteVolumeGroupSnapshot", "group", lambda o, b: pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=o.group, snapshot_ids=o.group_members), ("group_snapshot_id",),
        unknown_answer=None, id_kinds=("group",), empty_ok=("snapshot_ids",), malformed={"snapshot_ids": [OTHER]}),
    Row("GetVolumeGroupSnapshot", "group", lambda o, b: pb.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=o.group, snapshot_ids=o.group_members), ("group_snapshot_id",),
        id_kinds=("group",), empty_ok=("snapshot_ids",), malformed={"snapshot_ids": [OTHER]}),
]


def cases() -> list[Any]:
    """(row, field, variant) for every REQUIRED field; a field that is the only ID is walked once."""
    out = []
    for row in ROWS:
        for field in row.required:
            variants = VARIANTS if row.id_kinds else ("known",)
            for variant in variants:
                out.append(pytest.param(row, field, variant, id=f"{row.method}-{field}-{variant}"))
    return out


def clear(message: Message, path: str) -> None:
    """Clear the field at a dotted path ("volume_capabilities[0].access_mode"; a oneof by its name)."""
    *parents, last = path.split(".")
    for part in parents:
        name, _, index = part.partition("[")
        message = getattr(message, name)
        if index:
            message = message[int(index.rstrip("]"))]
    name, _, index = last.partition("[")
    if index:
        del getattr(message, name)[int(index.rstrip("]"))]
    else:
        message.ClearField(name)


def stub(csi: CSIClient, row: Row) -> Any:
    return getattr({"controller": csi.controller, "node": csi.node, "group": csi.group}[row.service], row.method)


async def objects(csi: CSIClient, variant: str, kinds: tuple[str, ...]) -> Objects:
    """IDs of `variant` for the kinds a row names; only 'known' creates anything."""
    if variant != "known" or not kinds:
        ids = UNKNOWN if variant != "malformed" else MALFORMED
        return Objects(ids["volume"], ids["snapshot"], ids["group"], [ids["snapshot"]])
    volume = (await csi.create_volume("pvc-known", 16 * MIB)).volume_id
    snapshot = group = ""
    members: list[str] = []
    if "snapshot" in kinds:
        snapshot = (await csi.create_snapshot("snap-known", volume)).snapshot_id
    if "group" in kinds:
        made = await csi.create_group_snapshot("group-known", [volume])
        group, members = made.group_snapshot_id, [s.snapshot_id for s in made.snapshots]
    return Objects(volume, snapshot, group, members)


def expected(row: Row, field: str) -> Code:
    if not row.offered:
        return Code.UNIMPLEMENTED
    return row.codes.get(field, Code.INVALID_ARGUMENT)


@pytest.mark.parametrize("row, field, variant", cases())
async def test_a_missing_required_field_outranks_every_id(
    box: Sandbox, csi: CSIClient, row: Row, field: str, variant: str
) -> None:
    request = row.build(await objects(csi, variant, row.id_kinds), box)
    clear(request, field)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub(csi, row)(request, timeout=60)
    code, details = info.value.code(), info.value.details() or ""
    want = expected(row, field)
    assert code == want, f"{row.method} without {field} ({variant} IDs): {code.name} {details!r}, want {want.name}"
    if want != Code.UNIMPLEMENTED:
        assert field in details, f"{row.method}: message {details!r} does not name {field!r}"


@pytest.mark.parametrize("row", ROWS, ids=[r.method for r in ROWS])
async def test_the_complete_request_with_unknown_ids_gets_past_the_check(box: Sandbox, csi: CSIClient, row: Row) -> None:
    """Baseline: the template of each row is complete, so the rows above fail for their field only."""
    request = row.build(await objects(csi, "unknown", row.id_kinds), box)
    try:
        await stub(csi, row)(request, timeout=60)
    except grpc.aio.AioRpcError as error:
        assert error.code() == row.unknown_answer, f"{row.method}: {error.code().name} {error.details()!r}"
        details = error.details() or ""
        assert row.unknown_answer == Code.UNIMPLEMENTED or any(u in details for u in UNKNOWN.values()), (
            f"{row.method}: message {details!r} names no unknown ID"
        )
    else:
        assert row.unknown_answer is None, f"{row.method}: succeeded, want {row.unknown_answer}"


def content_cases(kind: str) -> list[Any]:
    out = []
    for row in ROWS:
        for field in (row.empty_ok if kind == "empty" else tuple(row.malformed)):
            for variant in ("known", "unknown", "malformed"):
                out.append(pytest.param(row, field, variant, id=f"{row.method}-{field}-{variant}"))
    return out


async def answer(csi: CSIClient, row: Row, request: Message) -> tuple[Code, str]:
    try:
        await stub(csi, row)(request, timeout=60)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return Code.OK, ""


def unknown_code(row: Row) -> Code:
    return row.unknown_answer if row.unknown_answer is not None else Code.OK


@pytest.mark.parametrize("row, field, variant", content_cases("empty"))
async def test_an_empty_map_or_list_is_legal(box: Sandbox, csi: CSIClient, row: Row, field: str, variant: str) -> None:
    """proto3 sends an empty map or list as nothing: the request stands, answered as its IDs say."""
    request = row.build(await objects(csi, variant, row.id_kinds), box)
    clear(request, field)
    code, details = await answer(csi, row, request)
    want = Code.OK if variant == "known" else unknown_code(row)
    assert code == want, f"{row.method} with empty {field} ({variant} IDs): {code.name} {details!r}, want {want.name}"


@pytest.mark.parametrize("row, field, variant", content_cases("malformed"))
async def test_a_malformed_value_is_judged_after_the_ids(
    box: Sandbox, csi: CSIClient, row: Row, field: str, variant: str
) -> None:
    """What a present field holds is checked once its IDs are known: an unknown ID is NOT_FOUND first."""
    request = row.build(await objects(csi, variant, row.id_kinds), box)
    value = row.malformed[field]
    if isinstance(value, dict):
        getattr(request, field).clear()
        getattr(request, field).update(value)
    elif isinstance(value, list):
        del getattr(request, field)[:]
        getattr(request, field).extend(value)
    else:
        setattr(request, field, value)
    code, details = await answer(csi, row, request)
    want = row.malformed_known if variant == "known" else unknown_code(row)
    assert code == want, f"{row.method} with {field}={value!r} ({variant} IDs): {code.name} {details!r}, want {want.name}"
    if variant == "known" and want == Code.INVALID_ARGUMENT:
        assert field in details or any(str(v) in details for v in (value if isinstance(value, (dict, list)) else [value])), (
            f"{row.method}: message {details!r} names neither {field!r} nor its value")


async def test_rows_cover_every_rpc_of_the_spec_that_names_a_required_field() -> None:
    """No RPC with a REQUIRED field is missing from the walk (SnapshotMetadata is not served)."""
    walked = {row.method for row in ROWS}
    services = [s for s in pb.DESCRIPTOR.services_by_name.values() if s.name != "SnapshotMetadata"]
    with_fields = {
        m.name for s in services for m in s.methods
        if m.input_type.name not in {"GetPluginInfoRequest", "GetPluginCapabilitiesRequest", "ProbeRequest",
                                     "ListVolumesRequest", "ControllerGetCapabilitiesRequest", "ListSnapshotsRequest",
                                     "NodeGetCapabilitiesRequest", "NodeGetInfoRequest",
                                     "GroupControllerGetCapabilitiesRequest"}
    }
    assert with_fields == walked
