"""csi.required: the table of the spec's REQUIRED request fields, and the checks it runs."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import Message

from csi_qsd.csi import required
from csi_qsd.csi.errors import not_offered, rpc
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.errors import FailedPrecondition, InvalidArgument, Unimplemented
from tests.fakes.context import FakeContext

Mode = pb.VolumeCapability.AccessMode


def request_types() -> list[type[Message]]:
    return [
        getattr(pb, name) for name in pb.DESCRIPTOR.message_types_by_name if name.endswith("Request")
    ]


def test_every_request_of_the_spec_is_in_the_table() -> None:
    assert set(required.REQUIRED) == set(request_types())


@pytest.mark.parametrize("message_type", request_types(), ids=lambda t: t.__name__)
def test_every_rule_names_a_field_of_its_message(message_type: type[Message]) -> None:
    fields = set(message_type.DESCRIPTOR.fields_by_name)
    for rule in required.REQUIRED[message_type]:
        assert rule.field in fields, (message_type.__name__, rule.field)


def complete_capability() -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER))


@pytest.mark.parametrize("request_, field, error", [
    (pb.DeleteVolumeRequest(), "volume_id", InvalidArgument),
    (pb.CreateVolumeRequest(volume_capabilities=[complete_capability()]), "name", InvalidArgument),
    (pb.CreateVolumeRequest(name="n"), "volume_capabilities", InvalidArgument),
    (pb.CreateVolumeRequest(name="n", volume_capabilities=[complete_capability(), pb.VolumeCapability()]),
     "volume_capabilities[1].access_type", InvalidArgument),
    (pb.CreateVolumeRequest(name="n", volume_capabilities=[complete_capability()],
                            volume_content_source=pb.VolumeContentSource()),
     "volume_content_source", InvalidArgument),
    (pb.CreateVolumeRequest(name="n", volume_capabilities=[complete_capability()],
                            volume_content_source=pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource())),
     "volume_content_source.snapshot.snapshot_id", InvalidArgument),
    (pb.NodeStageVolumeRequest(volume_id="v", volume_capability=complete_capability()),
     "staging_target_path", InvalidArgument),
    (pb.NodeStageVolumeRequest(volume_id="v", staging_target_path="/s",
                               volume_capability=pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume())),
     "volume_capability.access_mode", InvalidArgument),
    (pb.NodeStageVolumeRequest(volume_id="v", staging_target_path="/s", volume_capability=pb.VolumeCapability(
        block=pb.VolumeCapability.BlockVolume(), access_mode=Mode(mode=Mode.UNKNOWN))),
     "volume_capability.access_mode", InvalidArgument),
    (pb.NodePublishVolumeRequest(volume_id="v", staging_target_path="/s", volume_capability=complete_capability()),
     "target_path", InvalidArgument),
    (pb.NodePublishVolumeRequest(volume_id="v", target_path="/t", volume_capability=complete_capability()),
     "staging_target_path", FailedPrecondition),
    # A missing REQUIRED field outranks a missing staging_target_path.
    (pb.NodePublishVolumeRequest(volume_id="v"), "target_path", InvalidArgument),
    (pb.NodeGetVolumeStatsRequest(volume_id="v"), "volume_path", InvalidArgument),
    (pb.NodeExpandVolumeRequest(volume_id="v", volume_path="/p", volume_capability=pb.VolumeCapability()),
     "volume_capability.access_type", InvalidArgument),
    (pb.CreateSnapshotRequest(name="n"), "source_volume_id", InvalidArgument),
    (pb.CreateVolumeGroupSnapshotRequest(name="n", source_volume_ids=["a", ""]), "source_volume_ids[1]",
     InvalidArgument),
    (pb.GetVolumeGroupSnapshotRequest(group_snapshot_id="g", snapshot_ids=["s", ""]), "snapshot_ids[1]",
     InvalidArgument),
])
def test_a_missing_field_raises_naming_it(request_: Message, field: str, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        required.check(request_)
    assert type(info.value) is error and field in str(info.value)


@pytest.mark.parametrize("request_", [
    pb.ProbeRequest(), pb.ListVolumesRequest(), pb.GetCapacityRequest(),
    pb.DeleteVolumeRequest(volume_id="anything, even malformed"),
    pb.NodePublishVolumeRequest(volume_id="v", staging_target_path="s", target_path="t",
                                volume_capability=complete_capability()),
    pb.NodeExpandVolumeRequest(volume_id="v", volume_path="p"),  # the capability is OPTIONAL here
    # Empty maps and lists a real CO sends: nothing to change, nothing to cross-check.
    pb.ControllerModifyVolumeRequest(volume_id="v"),
    pb.GetVolumeGroupSnapshotRequest(group_snapshot_id="g"),
    pb.DeleteVolumeGroupSnapshotRequest(group_snapshot_id="g"),
    # Present but malformed content is the handler's to judge, after its lookup.
    pb.NodeExpandVolumeRequest(volume_id="v", volume_path="some/path"),
    pb.NodeStageVolumeRequest(volume_id="v", staging_target_path="relative", volume_capability=complete_capability()),
    object(),  # not a CSI request: nothing to check
])
def test_a_complete_request_passes(request_: object) -> None:
    required.check(request_)


# The repeated fields without which a request leaves nothing to act on; every other one may be empty.
NEEDS_AN_ELEMENT = {
    ("CreateVolumeRequest", "volume_capabilities"), ("ValidateVolumeCapabilitiesRequest", "volume_capabilities"),
    ("CreateVolumeGroupSnapshotRequest", "source_volume_ids"),
}


@pytest.mark.parametrize("message_type", request_types(), ids=lambda t: t.__name__)
def test_an_empty_map_or_list_is_refused_only_where_nothing_is_left_to_act_on(message_type: type[Message]) -> None:
    """proto3 sends an empty map or list as nothing at all: a rule may demand an element only where listed."""
    fields = message_type.DESCRIPTOR.fields_by_name
    for rule in required.REQUIRED[message_type]:
        descriptor = fields[rule.field]
        if not descriptor.is_repeated:
            continue
        demands = getattr(rule, "required", True)
        assert demands == ((message_type.__name__, rule.field) in NEEDS_AN_ELEMENT), (message_type.__name__, rule)


class Servicer:
    def __init__(self) -> None:
        self.reached = False

    @rpc
    async def NodeUnpublishVolume(self, request: object, context: object) -> str:
        self.reached = True
        return "ok"

    @not_offered
    async def ControllerPublishVolume(self, request: object, context: object) -> str:
        raise Unimplemented("not offered")


async def test_rpc_checks_before_the_handler_runs() -> None:
    servicer, context = Servicer(), FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        await servicer.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="vol-x"), context)
    assert not servicer.reached
    assert context.aborts == [(grpc.StatusCode.INVALID_ARGUMENT, "target_path is required")]


async def test_an_rpc_not_offered_is_unimplemented_whatever_the_request_lacks() -> None:
    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        await Servicer().ControllerPublishVolume(pb.ControllerPublishVolumeRequest(), context)
    assert context.aborts == [(grpc.StatusCode.UNIMPLEMENTED, "not offered")]
