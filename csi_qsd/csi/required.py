"""The CSI spec's REQUIRED request fields, checked before any handler looks anything up.

The spec's error scheme answers a request that lacks a REQUIRED field with
INVALID_ARGUMENT, whatever else is wrong with it: an unknown volume ID must
not turn a missing `target_path` into NOT_FOUND, and a missing field must not
reach a lookup at all. So every request is checked against this table in one
place (`csi.errors.rpc`, before the handler runs), and handlers keep only
their semantic checks: a path's shape and place, a capability's support, a
parameter's value, whether an ID names something that exists.

The table transcribes the spec's message definitions (CSI v1.12.0): a scalar
or message field marked REQUIRED must be set. proto3 cannot tell an unset
scalar from its zero value, so an empty string or an UNKNOWN enum counts as
missing; a REQUIRED bool (`readonly`) can never be missing and is not listed.
proto3 cannot tell an empty map or list from a missing one either, and a real
CO sends them empty: a VolumeAttributesClass without parameters reaches
ControllerModifyVolume with no `mutable_parameters`, a group snapshot call may
come without `snapshot_ids`. So a map or repeated field is required to hold
an element only where an empty one leaves nothing to act on (no capability
to check or provide, no volume to snapshot); where empty means "nothing to
change" or "nothing to cross-check" it is legal, and the handler reads it so.
Only presence is checked here: what a present field holds (a path's shape
and place, a key's meaning) is the handler's to check, after it has looked
the request's ID up, so an unknown volume is NOT_FOUND however its path reads. Rules run in the order of the message's fields,
and an OPTIONAL message that is given must carry its own REQUIRED fields
(a `volume_capability` needs its access type and mode). The one rule that is
not INVALID_ARGUMENT comes last: NodePublishVolume without a
`staging_target_path` is FAILED_PRECONDITION, as the spec's table for that
RPC says when STAGE_UNSTAGE_VOLUME is advertised.

No I/O, no catalog, no gRPC: pure checks on the message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from google.protobuf.message import Message

from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.errors import DriverError, FailedPrecondition, InvalidArgument

_UNKNOWN_MODE = pb.VolumeCapability.AccessMode.UNKNOWN


class Rule(Protocol):
    @property
    def field(self) -> str:
        """The request field the rule is about, as the error message names it."""

    def check(self, request: Any) -> None:
        """Raise a DriverError naming `field` if the request breaks the rule."""


def _present(message: Any, name: str) -> bool:
    value = getattr(message, name)
    if isinstance(value, Message):
        return bool(message.HasField(name))
    if isinstance(value, (str, bytes, int)):
        return bool(value)
    return len(value) > 0  # a repeated or map field


@dataclasses.dataclass(frozen=True)
class Field:
    """A REQUIRED field: a string, ID, path, map, repeated or message field that must be set."""

    field: str
    error: type[DriverError] = InvalidArgument
    hint: str = ""

    def check(self, request: Any) -> None:
        if not _present(request, self.field):
            raise self.error(f"{self.field} is required{self.hint}")


@dataclasses.dataclass(frozen=True)
class IDs:
    """A repeated field of IDs, REQUIRED to hold one or legal when empty; none of those given may be empty."""

    field: str
    required: bool = True

    def check(self, request: Any) -> None:
        values = list(getattr(request, self.field))
        if not values and self.required:
            raise InvalidArgument(f"{self.field} is required: list at least one ID")
        for i, value in enumerate(values):
            if not value:
                raise InvalidArgument(f"{self.field}[{i}] is required: an ID must not be empty")


def check_capability(cap: pb.VolumeCapability, field: str) -> None:
    """A VolumeCapability's own REQUIRED parts: one access type and an access mode that is not UNKNOWN."""
    if cap.WhichOneof("access_type") is None:
        raise InvalidArgument(f"{field}.access_type is required (block or mount)")
    if not cap.HasField("access_mode") or cap.access_mode.mode == _UNKNOWN_MODE:
        raise InvalidArgument(f"{field}.access_mode is required (a mode other than UNKNOWN)")


@dataclasses.dataclass(frozen=True)
class Capability:
    """A single `volume_capability`, REQUIRED or OPTIONAL; when given it must be complete."""

    field: str
    required: bool = True

    def check(self, request: Any) -> None:
        if not request.HasField(self.field):
            if self.required:
                raise InvalidArgument(f"{self.field} is required")
            return
        check_capability(getattr(request, self.field), self.field)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """A repeated `volume_capabilities`, REQUIRED or OPTIONAL; each one given must be complete."""

    field: str
    required: bool = True

    def check(self, request: Any) -> None:
        caps = list(getattr(request, self.field))
        if not caps and self.required:
            raise InvalidArgument(f"{self.field} is required: list at least one capability")
        for i, cap in enumerate(caps):
            check_capability(cap, f"{self.field}[{i}]")


@dataclasses.dataclass(frozen=True)
class ContentSource:
    """An OPTIONAL `volume_content_source`: when given, one source type and that source's REQUIRED ID."""

    field: str

    def check(self, request: Any) -> None:
        if not request.HasField(self.field):
            return
        source = getattr(request, self.field)
        kind = source.WhichOneof("type")
        if kind is None:
            raise InvalidArgument(f"{self.field} must name a snapshot or a volume: {self.field}.type is required")
        inner = "snapshot_id" if kind == "snapshot" else "volume_id"
        if not getattr(getattr(source, kind), inner):
            raise InvalidArgument(f"{self.field}.{kind}.{inner} is required")


_NOT_STAGED = (
    ": the driver advertises STAGE_UNSTAGE_VOLUME, so call NodeStageVolume first and pass its staging_target_path"
)

# Request type → its REQUIRED fields, in the spec's field order. Every request of
# the spec is listed (an empty tuple: nothing is required), so a new RPC cannot
# slip past the check unnoticed (tests/unit/test_required.py holds the table to that).
REQUIRED: Mapping[type[Message], tuple[Rule, ...]] = {
    # Identity
    pb.GetPluginInfoRequest: (),
    pb.GetPluginCapabilitiesRequest: (),
    pb.ProbeRequest: (),
    # Controller
    pb.CreateVolumeRequest: (Field("name"), Capabilities("volume_capabilities"), ContentSource("volume_content_source")),
    pb.DeleteVolumeRequest: (Field("volume_id"),),
    pb.ControllerPublishVolumeRequest: (Field("volume_id"), Field("node_id"), Capability("volume_capability")),
    pb.ControllerUnpublishVolumeRequest: (Field("volume_id"),),
    pb.ValidateVolumeCapabilitiesRequest: (Field("volume_id"), Capabilities("volume_capabilities")),
    pb.ListVolumesRequest: (),
    pb.ControllerGetVolumeRequest: (Field("volume_id"),),
    # Empty mutable_parameters: a VolumeAttributesClass without parameters, nothing to change.
    pb.ControllerModifyVolumeRequest: (Field("volume_id"),),
    pb.GetCapacityRequest: (Capabilities("volume_capabilities", required=False),),
    pb.ControllerGetCapabilitiesRequest: (),
    pb.CreateSnapshotRequest: (Field("source_volume_id"), Field("name")),
    pb.DeleteSnapshotRequest: (Field("snapshot_id"),),
    pb.ListSnapshotsRequest: (),
    pb.GetSnapshotRequest: (Field("snapshot_id"),),
    pb.ControllerExpandVolumeRequest: (
        Field("volume_id"), Field("capacity_range"), Capability("volume_capability", required=False),
    ),
    # Node
    pb.NodeStageVolumeRequest: (Field("volume_id"), Field("staging_target_path"), Capability("volume_capability")),
    pb.NodeUnstageVolumeRequest: (Field("volume_id"), Field("staging_target_path")),
    pb.NodePublishVolumeRequest: (
        Field("volume_id"), Field("target_path"), Capability("volume_capability"),
        Field("staging_target_path", FailedPrecondition, _NOT_STAGED),
    ),
    pb.NodeUnpublishVolumeRequest: (Field("volume_id"), Field("target_path")),
    pb.NodeGetVolumeStatsRequest: (Field("volume_id"), Field("volume_path")),
    pb.NodeExpandVolumeRequest: (
        Field("volume_id"), Field("volume_path"), Capability("volume_capability", required=False),
    ),
    pb.NodeGetCapabilitiesRequest: (),
    pb.NodeGetInfoRequest: (),
    # GroupController
    pb.GroupControllerGetCapabilitiesRequest: (),
    pb.CreateVolumeGroupSnapshotRequest: (Field("name"), IDs("source_volume_ids")),
    # Empty snapshot_ids: nothing to cross-check the group's members against.
    pb.DeleteVolumeGroupSnapshotRequest: (Field("group_snapshot_id"), IDs("snapshot_ids", required=False)),
    pb.GetVolumeGroupSnapshotRequest: (Field("group_snapshot_id"), IDs("snapshot_ids", required=False)),
    # SnapshotMetadata (not served; listed so the table covers the whole spec)
    pb.GetMetadataAllocatedRequest: (Field("snapshot_id"),),
    pb.GetMetadataDeltaRequest: (Field("base_snapshot_id"), Field("target_snapshot_id")),
}


def check(request: object) -> None:
    """Raise the spec's error for the first REQUIRED field `request` lacks; nothing for types not in the table.

    Raises InvalidArgument naming the field (FailedPrecondition for
    NodePublishVolume's `staging_target_path`).
    """
    for rule in REQUIRED.get(type(request), ()):
        rule.check(request)
