"""The committed bindings match proto/csi.proto, and that matches CSI v1.12.

Regenerating with scripts/gen_proto.py into a temporary directory must give
the same descriptor and the same gRPC module as the files committed under
csi_qsd/csi_pb/; spot checks then pin the wire contract to facts of the
CSI v1.12 spec, so an edit of the .proto that drifts from them fails even when the bindings were regenerated
with it.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from csi_qsd.csi_pb import csi_pb2, csi_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_proto.py"
COMMITTED_DIR = REPO_ROOT / "csi_qsd" / "csi_pb"
# Each .proto and the message module committed for it.
PROTOS: dict[str, ModuleType] = {"csi": csi_pb2}


def _load_gen_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("csi_qsd_gen_proto", GEN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("csi_pb")
    _load_gen_script().generate(out_dir)
    return out_dir


def _serialized_file_descriptor(pb2_source: str) -> bytes:
    """The bytes literal passed to AddSerializedFile(...) in a generated *_pb2.py."""
    for node in ast.walk(ast.parse(pb2_source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
        ):
            (arg,) = node.args
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, bytes)
            return arg.value
    raise AssertionError("no AddSerializedFile(...) call in generated *_pb2.py")


def _file_descriptor(data: bytes) -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(data)


# --- the committed generated code is what proto/*.proto compile to -----------


def test_generate_writes_three_modules_per_proto(fresh_dir: Path) -> None:
    names = sorted(p.name for p in fresh_dir.iterdir() if p.is_file())
    assert names == sorted(f"{stem}{suffix}" for stem in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


@pytest.mark.parametrize("stem", sorted(PROTOS))
def test_descriptor_matches_fresh_compile(fresh_dir: Path, stem: str) -> None:
    fresh = _file_descriptor(
        _serialized_file_descriptor((fresh_dir / f"{stem}_pb2.py").read_text(encoding="utf-8"))
    )
    committed = _file_descriptor(PROTOS[stem].DESCRIPTOR.serialized_pb)
    assert fresh.name == f"{stem}.proto"
    assert fresh == committed, (
        f"csi_qsd/csi_pb/{stem}_pb2.py is stale: run `python scripts/gen_proto.py`"
    )


@pytest.mark.parametrize("stem", sorted(PROTOS))
def test_grpc_module_matches_fresh_compile(fresh_dir: Path, stem: str) -> None:
    fresh = (fresh_dir / f"{stem}_pb2_grpc.py").read_text(encoding="utf-8")
    committed = (COMMITTED_DIR / f"{stem}_pb2_grpc.py").read_text(encoding="utf-8")
    assert f"from . import {stem}_pb2 as {stem}__pb2\n" in fresh
    assert f"\nimport {stem}_pb2" not in fresh
    assert fresh == committed, (
        f"csi_qsd/csi_pb/{stem}_pb2_grpc.py is stale: run `python scripts/gen_proto.py`"
    )


@pytest.mark.parametrize("stem", sorted(PROTOS))
def test_type_stubs_match_fresh_compile(fresh_dir: Path, stem: str) -> None:
    fresh = (fresh_dir / f"{stem}_pb2.pyi").read_text(encoding="utf-8")
    committed = (COMMITTED_DIR / f"{stem}_pb2.pyi").read_text(encoding="utf-8")
    assert fresh == committed, (
        f"csi_qsd/csi_pb/{stem}_pb2.pyi is stale: run `python scripts/gen_proto.py`"
    )


# --- spot checks of the CSI v1.12 wire contract ------------------------------

V1_12_SERVICES: dict[str, list[str]] = {
    "Identity": ["GetPluginInfo", "GetPluginCapabilities", "Probe"],
    "Controller": [
        "CreateVolume",
        "DeleteVolume",
        "ControllerPublishVolume",
        "ControllerUnpublishVolume",
        "ValidateVolumeCapabilities",
        "ListVolumes",
        "GetCapacity",
        "ControllerGetCapabilities",
        "CreateSnapshot",
        "DeleteSnapshot",
        "ListSnapshots",
        "GetSnapshot",
        "ControllerExpandVolume",
        "ControllerGetVolume",
        "ControllerModifyVolume",
    ],
    "GroupController": [
        "GroupControllerGetCapabilities",
        "CreateVolumeGroupSnapshot",
        "DeleteVolumeGroupSnapshot",
        "GetVolumeGroupSnapshot",
    ],
    "SnapshotMetadata": ["GetMetadataAllocated", "GetMetadataDelta"],
    "Node": [
        "NodeStageVolume",
        "NodeUnstageVolume",
        "NodePublishVolume",
        "NodeUnpublishVolume",
        "NodeGetVolumeStats",
        "NodeExpandVolume",
        "NodeGetCapabilities",
        "NodeGetInfo",
    ],
}


def _field_numbers(message: type[Message]) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_file_identity() -> None:
    fd = csi_pb2.DESCRIPTOR
    assert fd.package == "csi.v1"
    assert list(fd.dependencies) and sorted(d.name for d in fd.dependencies) == [
        "google/protobuf/descriptor.proto",
        "google/protobuf/timestamp.proto",
        "google/protobuf/wrappers.proto",
    ]
    fdp = _file_descriptor(fd.serialized_pb)
    assert fdp.options.go_package == "github.com/container-storage-interface/spec/lib/go/csi"


def test_services_and_methods() -> None:
    services = csi_pb2.DESCRIPTOR.services_by_name
    assert list(services) == list(V1_12_SERVICES)
    for name, methods in V1_12_SERVICES.items():
        assert [m.name for m in services[name].methods] == methods, name


def test_snapshot_metadata_rpcs_are_server_streaming() -> None:
    fdp = _file_descriptor(csi_pb2.DESCRIPTOR.serialized_pb)
    (svc,) = [s for s in fdp.service if s.name == "SnapshotMetadata"]
    assert [(m.client_streaming, m.server_streaming) for m in svc.method] == [
        (False, True),
        (False, True),
    ]
    others = [m for s in fdp.service if s.name != "SnapshotMetadata" for m in s.method]
    assert not any(m.client_streaming or m.server_streaming for m in others)


def test_grpc_method_paths() -> None:
    assert hasattr(csi_pb2_grpc, "add_NodeServicer_to_server")
    assert hasattr(csi_pb2_grpc, "SnapshotMetadataStub")
    source = (COMMITTED_DIR / "csi_pb2_grpc.py").read_text(encoding="utf-8")
    for service, methods in V1_12_SERVICES.items():
        for method in methods:
            assert f"'/csi.v1.{service}/{method}'" in source


def test_create_volume_request_fields() -> None:
    assert _field_numbers(csi_pb2.CreateVolumeRequest) == {
        "name": 1,
        "capacity_range": 2,
        "volume_capabilities": 3,
        "parameters": 4,
        "secrets": 5,
        "volume_content_source": 6,
        "accessibility_requirements": 7,
        "mutable_parameters": 8,
    }


def test_node_stage_and_publish_request_fields() -> None:
    assert _field_numbers(csi_pb2.NodeStageVolumeRequest) == {
        "volume_id": 1,
        "publish_context": 2,
        "staging_target_path": 3,
        "volume_capability": 4,
        "secrets": 5,
        "volume_context": 6,
    }
    assert _field_numbers(csi_pb2.NodePublishVolumeRequest) == {
        "volume_id": 1,
        "publish_context": 2,
        "staging_target_path": 3,
        "target_path": 4,
        "volume_capability": 5,
        "readonly": 6,
        "secrets": 7,
        "volume_context": 8,
    }


def test_other_field_numbers_and_types() -> None:
    assert _field_numbers(csi_pb2.Volume) == {
        "capacity_bytes": 1,
        "volume_id": 2,
        "volume_context": 3,
        "content_source": 4,
        "accessible_topology": 5,
    }
    assert _field_numbers(csi_pb2.NodeGetInfoResponse) == {
        "node_id": 1,
        "max_volumes_per_node": 2,
        "accessible_topology": 3,
    }
    assert _field_numbers(csi_pb2.NodeExpandVolumeRequest) == {
        "volume_id": 1,
        "volume_path": 2,
        "capacity_range": 3,
        "staging_target_path": 4,
        "volume_capability": 5,
        "secrets": 6,
    }
    assert _field_numbers(csi_pb2.GetMetadataDeltaRequest) == {
        "base_snapshot_id": 1,
        "target_snapshot_id": 2,
        "starting_offset": 3,
        "max_results": 4,
        "secrets": 5,
    }
    fields = csi_pb2.CapacityRange.DESCRIPTOR.fields_by_name
    assert fields["required_bytes"].type == FieldDescriptor.TYPE_INT64
    assert fields["limit_bytes"].type == FieldDescriptor.TYPE_INT64
    oneof = csi_pb2.VolumeCapability.DESCRIPTOR.oneofs_by_name["access_type"]
    assert [(f.name, f.number) for f in oneof.fields] == [("block", 1), ("mount", 2)]


def test_access_mode_enum() -> None:
    mode = csi_pb2.VolumeCapability.AccessMode.Mode
    assert dict(mode.items()) == {
        "UNKNOWN": 0,
        "SINGLE_NODE_WRITER": 1,
        "SINGLE_NODE_READER_ONLY": 2,
        "MULTI_NODE_READER_ONLY": 3,
        "MULTI_NODE_SINGLE_WRITER": 4,
        "MULTI_NODE_MULTI_WRITER": 5,
        "SINGLE_NODE_SINGLE_WRITER": 6,
        "SINGLE_NODE_MULTI_WRITER": 7,
    }


def test_capability_enums() -> None:
    rpc = csi_pb2.ControllerServiceCapability.RPC.Type
    assert rpc.Value("MODIFY_VOLUME") == 14
    assert rpc.Value("GET_SNAPSHOT") == 15
    assert max(rpc.values()) == 15
    node = csi_pb2.NodeServiceCapability.RPC.Type
    assert node.Value("STAGE_UNSTAGE_VOLUME") == 1
    assert node.Value("VOLUME_MOUNT_GROUP") == 6
    assert max(node.values()) == 6
    plugin = csi_pb2.PluginCapability.Service.Type
    assert plugin.Value("SNAPSHOT_METADATA_SERVICE") == 4


def test_extensions() -> None:
    expected = {
        "alpha_enum": ("google.protobuf.EnumOptions", 1060),
        "alpha_enum_value": ("google.protobuf.EnumValueOptions", 1060),
        "csi_secret": ("google.protobuf.FieldOptions", 1059),
        "alpha_field": ("google.protobuf.FieldOptions", 1060),
        "alpha_message": ("google.protobuf.MessageOptions", 1060),
        "alpha_method": ("google.protobuf.MethodOptions", 1060),
        "alpha_service": ("google.protobuf.ServiceOptions", 1060),
    }
    exts = csi_pb2.DESCRIPTOR.extensions_by_name
    assert {
        name: (ext.containing_type.full_name, ext.number) for name, ext in exts.items()
    } == expected


def test_secret_and_alpha_annotations() -> None:
    secrets = csi_pb2.NodeStageVolumeRequest.DESCRIPTOR.fields_by_name["secrets"]
    assert secrets.GetOptions().Extensions[csi_pb2.csi_secret] is True
    expand = csi_pb2.NodeExpandVolumeRequest.DESCRIPTOR.fields_by_name["secrets"]
    assert expand.GetOptions().Extensions[csi_pb2.csi_secret] is True
    assert expand.GetOptions().Extensions[csi_pb2.alpha_field] is True
    services = csi_pb2.DESCRIPTOR.services_by_name
    assert services["SnapshotMetadata"].GetOptions().Extensions[csi_pb2.alpha_service]
    modify = services["Controller"].methods_by_name["ControllerModifyVolume"]
    assert not modify.GetOptions().Extensions[csi_pb2.alpha_method]  # GA since v1.12
    get_volume = services["Controller"].methods_by_name["ControllerGetVolume"]
    assert get_volume.GetOptions().Extensions[csi_pb2.alpha_method]


def test_wire_encoding() -> None:
    # Tag bytes are (field_number << 3) | wire_type, so these pin the numbers
    # independently of the descriptor API.
    assert csi_pb2.CreateVolumeRequest(name="v").SerializeToString() == b"\x0a\x01v"
    assert (
        csi_pb2.NodeStageVolumeRequest(staging_target_path="/s").SerializeToString()
        == b"\x1a\x02/s"
    )
    assert (
        csi_pb2.NodePublishVolumeRequest(readonly=True).SerializeToString() == b"\x30\x01"
    )
    cap = csi_pb2.VolumeCapability(
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER
        )
    )
    assert cap.SerializeToString() == b"\x1a\x02\x08\x07"
    decoded = csi_pb2.CreateVolumeRequest.FromString(b"\x0a\x01v\x42\x06\x0a\x01k\x12\x01x")
    assert decoded.name == "v"
    assert dict(decoded.mutable_parameters) == {"k": "x"}
