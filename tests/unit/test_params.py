"""StorageClass parameters: every key, every bad value named by its key, and the catalog's JSON form."""

from __future__ import annotations

import dataclasses
import json

import pytest

from csi_qsd import params as P
from csi_qsd.errors import InvalidArgument
from csi_qsd.qcow2.granularity import qcow2_options
from csi_qsd.sys.volume_keys import VolumeKey

VHOST = {"export": "vhost-user-blk"}
KIB, MIB = 1 << 10, 1 << 20


def test_no_parameters_gives_the_safe_defaults() -> None:
    got = P.parse_parameters({})
    assert got == P.VolumeParameters()
    assert got.format is P.ImageFormat.QCOW2
    assert got.export is P.ExportKind.FILESYSTEM
    assert got.cache is P.CacheMode.WRITETHROUGH  # the crash-safe choice (see DESIGN.md)
    assert got.preallocation is P.Preallocation.OFF


# (parameters, the VolumeParameters field to check, its value)
CASES: list[tuple[dict[str, str], str, object]] = [
    ({"format": "qcow2"}, "format", P.ImageFormat.QCOW2),
    ({"format": "raw"}, "format", P.ImageFormat.RAW),
    ({"preallocation": "off"}, "preallocation", P.Preallocation.OFF),
    ({"preallocation": "metadata"}, "preallocation", P.Preallocation.METADATA),
    ({"preallocation": "falloc"}, "preallocation", P.Preallocation.FALLOC),
    ({"format": "raw", "preallocation": "full"}, "preallocation", P.Preallocation.FULL),
    ({"export": "filesystem"}, "export", P.ExportKind.FILESYSTEM),
    ({"export": "vhost-user-blk"}, "export", P.ExportKind.VHOST_USER_BLK),
    ({**VHOST, "numQueues": "1"}, "num_queues", 1),
    ({**VHOST, "numQueues": "64"}, "num_queues", 64),
    ({**VHOST, "logicalBlockSize": "512"}, "logical_block_size", 512),
    ({**VHOST, "logicalBlockSize": "4096"}, "logical_block_size", 4096),
    ({**VHOST, "cache": "writethrough"}, "cache", P.CacheMode.WRITETHROUGH),
    ({**VHOST, "cache": "writeback"}, "cache", P.CacheMode.WRITEBACK),
    ({"discard": "unmap"}, "discard", P.Discard.UNMAP),
    ({"discard": "ignore"}, "discard", P.Discard.IGNORE),
    ({"detectZeroes": "off"}, "detect_zeroes", P.DetectZeroes.OFF),
    ({"detectZeroes": "on"}, "detect_zeroes", P.DetectZeroes.ON),
    ({"detectZeroes": "unmap"}, "detect_zeroes", P.DetectZeroes.UNMAP),
    ({**VHOST, "iothreadPollMaxNs": "0"}, "iothread_poll_max_ns", 0),
    ({**VHOST, "iothreadPollMaxNs": "1000000"}, "iothread_poll_max_ns", 1_000_000),
    ({**VHOST, "vmmGroup": "107"}, "vmm_group", "107"),
    ({"pool": "default"}, "pool", "default"),
    ({"pool": "nvme-0"}, "pool", "nvme-0"),
    ({"pool": "nvme-0"}, "format", P.ImageFormat.RAW),  # a device pool's volumes are raw extents
    ({}, "granularity", 64 * KIB),
    ({"changedBlockGranularity": "4Ki"}, "granularity", 4 * KIB),
    ({"changedBlockGranularity": "4096"}, "granularity", 4 * KIB),
    ({"changedBlockGranularity": "32Ki"}, "granularity", 32 * KIB),
    ({"changedBlockGranularity": "64Ki"}, "granularity", 64 * KIB),
    ({"changedBlockGranularity": "2Mi"}, "granularity", 2 * MIB),
    ({}, "encrypted", False),
    ({"encrypted": "false"}, "encrypted", False),
    ({"encrypted": "true"}, "encrypted", True),
]


@pytest.mark.parametrize("parameters, field, value", CASES)
def test_every_key_and_value(parameters: dict[str, str], field: str, value: object) -> None:
    assert getattr(P.parse_parameters(parameters), field) == value


def test_every_supported_key_is_covered_above() -> None:
    """Each key the parser accepts (its own table: key -> the field it sets) has a case above checking that field."""
    checked = {(key, field) for parameters, field, _ in CASES for key in parameters}
    uncovered = sorted(key for key, (field, _) in P._PARSERS.items() if (key, field) not in checked)
    assert not uncovered, f"keys parse_parameters accepts that no case of test_every_key_and_value checks: {uncovered}"


def test_provisioner_keys_are_ignored() -> None:
    parameters = {
        "csi.storage.k8s.io/pvc/name": "data", "csi.storage.k8s.io/pvc/namespace": "default",
        "csi.storage.k8s.io/pv/name": "pvc-1", "csi.storage.k8s.io/fstype": "xfs", "format": "raw",
    }
    assert P.parse_parameters(parameters) == P.VolumeParameters(format=P.ImageFormat.RAW)


@pytest.mark.parametrize("key", ["fromat", "Format", "size", "fsType", "csi.storage.k8s.io", "", "storage.k8s.io/x"])
def test_unknown_key_is_named(key: str) -> None:
    with pytest.raises(InvalidArgument, match="unknown StorageClass parameter") as info:
        P.parse_parameters({"format": "qcow2", key: "x"})
    assert repr(key) in str(info.value)
    assert "supported:" in str(info.value) and "numQueues" in str(info.value)


@pytest.mark.parametrize("parameters, key", [
    ({"format": "vmdk"}, "format"),
    ({"format": "QCOW2"}, "format"),
    ({"format": ""}, "format"),
    ({"preallocation": "maybe"}, "preallocation"),
    ({"export": "nbd"}, "export"),
    ({"export": "vhost_user_blk"}, "export"),
    ({**VHOST, "numQueues": "0"}, "numQueues"),
    ({**VHOST, "numQueues": "65"}, "numQueues"),
    ({**VHOST, "numQueues": "four"}, "numQueues"),
    ({**VHOST, "numQueues": "-1"}, "numQueues"),
    ({**VHOST, "numQueues": "4.0"}, "numQueues"),
    ({**VHOST, "numQueues": " 4"}, "numQueues"),
    ({**VHOST, "numQueues": "+4"}, "numQueues"),
    ({**VHOST, "numQueues": "1_6"}, "numQueues"),
    ({**VHOST, "numQueues": "\u0664"}, "numQueues"),  # ARABIC-INDIC DIGIT FOUR: int() would take it
    ({**VHOST, "numQueues": ""}, "numQueues"),
    ({**VHOST, "numQueues": "9" * 5000}, "numQueues"),  # int() refuses > 4300 digits with ValueError
    ({**VHOST, "logicalBlockSize": "1024"}, "logicalBlockSize"),
    ({**VHOST, "logicalBlockSize": "4k"}, "logicalBlockSize"),
    ({**VHOST, "cache": "none"}, "cache"),
    ({**VHOST, "cache": "directsync"}, "cache"),
    ({"discard": "on"}, "discard"),
    ({"detectZeroes": "true"}, "detectZeroes"),
    ({**VHOST, "iothreadPollMaxNs": "-1"}, "iothreadPollMaxNs"),
    ({**VHOST, "iothreadPollMaxNs": "1000001"}, "iothreadPollMaxNs"),
    ({**VHOST, "iothreadPollMaxNs": "1e3"}, "iothreadPollMaxNs"),
    ({"changedBlockGranularity": "2Ki"}, "changedBlockGranularity"),  # below a page: nothing gained
    ({"changedBlockGranularity": "4Mi"}, "changedBlockGranularity"),  # above qcow2's largest cluster
    ({"changedBlockGranularity": "48Ki"}, "changedBlockGranularity"),  # not a power of two
    ({"changedBlockGranularity": "0"}, "changedBlockGranularity"),
    ({"changedBlockGranularity": "4k"}, "changedBlockGranularity"),
    ({"changedBlockGranularity": "4KiB"}, "changedBlockGranularity"),
    ({"changedBlockGranularity": "Ki"}, "changedBlockGranularity"),
    ({"changedBlockGranularity": " 4Ki"}, "changedBlockGranularity"),
    ({"changedBlockGranularity": "9" * 5000}, "changedBlockGranularity"),
    ({"encrypted": "yes"}, "encrypted"),
    ({"encrypted": "True"}, "encrypted"),
    ({"encrypted": "true", "format": "raw"}, "encrypted"),  # QEMU's LUKS here is qcow2's
    ({"encrypted": "true", "pool": "nvme-0", "format": "qcow2"}, "encrypted"),
])
def test_bad_value_is_invalid_argument_naming_the_key(parameters: dict[str, str], key: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        P.parse_parameters(parameters)
    message = str(info.value)
    assert f"parameter {key!r}" in message


@pytest.mark.parametrize("key, value", [
    ("numQueues", "2"), ("logicalBlockSize", "4096"), ("cache", "writeback"), ("iothreadPollMaxNs", "0"),
])
@pytest.mark.parametrize("export", [None, "filesystem"])
def test_vhost_only_keys_need_the_vhost_export(key: str, value: str, export: str | None) -> None:
    parameters = {key: value} if export is None else {"export": export, key: value}
    with pytest.raises(InvalidArgument, match="applies only to export 'vhost-user-blk'") as info:
        P.parse_parameters(parameters)
    assert repr(key) in str(info.value)


@pytest.mark.parametrize("parameters", [
    {"format": "raw", "changedBlockGranularity": "4Ki"},
    {"pool": "nvme", "changedBlockGranularity": "64Ki"},  # a device pool's volumes are raw extents
])
def test_granularity_needs_qcow2(parameters: dict[str, str]) -> None:
    with pytest.raises(InvalidArgument, match="'changedBlockGranularity' applies only to format 'qcow2'"):
        P.parse_parameters(parameters)


@pytest.mark.parametrize("granularity, options", [
    (4 * KIB, ["cluster_size=131072", "extended_l2=on"]),  # 32 subclusters of 4 KiB
    (32 * KIB, ["cluster_size=1048576", "extended_l2=on"]),
    (64 * KIB, []),  # qemu-img's default: the layout of every volume made before the parameter
    (128 * KIB, ["cluster_size=131072"]),
    (2 * MIB, ["cluster_size=2097152"]),
])
def test_granularity_is_the_qcow2_cluster_or_subcluster(granularity: int, options: list[str]) -> None:
    assert qcow2_options(granularity) == options


def test_metadata_preallocation_needs_qcow2() -> None:
    with pytest.raises(InvalidArgument, match="'preallocation'.*'qcow2'"):
        P.parse_parameters({"format": "raw", "preallocation": "metadata"})


ALL_SET = P.VolumeParameters(
    format=P.ImageFormat.RAW, preallocation=P.Preallocation.FALLOC, export=P.ExportKind.VHOST_USER_BLK,
    num_queues=7, logical_block_size=4096, cache=P.CacheMode.WRITEBACK, discard=P.Discard.IGNORE,
    detect_zeroes=P.DetectZeroes.UNMAP, iothread_poll_max_ns=32768, granularity=8 * KIB,
)


@pytest.mark.parametrize("value", [P.VolumeParameters(), ALL_SET], ids=["defaults", "all-set"])
def test_json_round_trip(value: P.VolumeParameters) -> None:
    text = value.to_json()
    assert json.loads(text)  # plain JSON, readable in the catalog
    assert P.VolumeParameters.from_json(text) == value


def test_json_round_trip_of_parsed_parameters() -> None:
    parsed = P.parse_parameters({
        "format": "raw", "preallocation": "falloc", "export": "vhost-user-blk", "numQueues": "7",
        "logicalBlockSize": "4096", "cache": "writeback", "discard": "ignore", "detectZeroes": "unmap",
        "iothreadPollMaxNs": "32768",
    })
    assert parsed == dataclasses.replace(ALL_SET, granularity=64 * KIB)
    assert P.VolumeParameters.from_json(parsed.to_json()) == parsed


def test_json_form_is_stable_and_stores_enum_values() -> None:
    raw = json.loads(ALL_SET.to_json())
    assert raw == {
        "format": "raw", "preallocation": "falloc", "export": "vhost-user-blk", "num_queues": 7,
        "logical_block_size": 4096, "cache": "writeback", "discard": "ignore", "detect_zeroes": "unmap",
        "iothread_poll_max_ns": 32768, "vmm_group": "", "pool": "default", "granularity": 8192,
        "namespace": "", "encrypted": False,
    }
    assert ALL_SET.to_json() == ALL_SET.to_json() and list(raw) == sorted(raw)


def test_json_from_an_older_row_fills_new_fields_with_defaults() -> None:
    """A catalog row written before a field existed still loads (and means the default)."""
    assert P.VolumeParameters.from_json('{"format": "raw"}') == P.VolumeParameters(format=P.ImageFormat.RAW)
    # Rows from before the granularity existed describe 64 KiB-cluster images: the default is exactly that.
    assert P.VolumeParameters.from_json('{"format": "qcow2"}').granularity == 64 * KIB


def test_the_claims_namespace_is_kept_but_does_not_tell_volumes_apart() -> None:
    """The provisioner's namespace key places the volume (QSD shards); other provisioner keys are dropped."""
    params = P.parse_parameters({"csi.storage.k8s.io/pvc/namespace": "team-a", "csi.storage.k8s.io/pvc/name": "x"})
    assert params.namespace == "team-a"
    assert P.VolumeParameters.from_json(params.to_json()).namespace == "team-a"
    assert params == P.parse_parameters({})  # a retry without the key is the same volume


def test_parameters_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.VolumeParameters().num_queues = 8  # type: ignore[misc]


def test_an_encrypted_volume_s_key_comes_from_the_secret_s_entry_and_is_never_shown() -> None:
    key = P.volume_key({"key": "s3cr3t-passphrase", "other": "x"}, "volume 'v'", P.NODE_STAGE_SECRET)
    assert key == VolumeKey("s3cr3t-passphrase") and key != VolumeKey("another")
    assert "s3cr3t" not in repr(key) and "s3cr3t" not in str(key)
    for secrets in ({}, {"key": ""}, {"password": "s3cr3t-passphrase"}):
        with pytest.raises(InvalidArgument) as info:
            P.volume_key(secrets, "volume 'v'", P.NODE_STAGE_SECRET)
        message = str(info.value)
        assert P.NODE_STAGE_SECRET in message and "'key'" in message and "volume 'v'" in message
        assert "s3cr3t" not in message


def test_encrypted_survives_the_catalog_s_json_and_old_rows_read_as_plain() -> None:
    params = P.parse_parameters({"encrypted": "true"})
    assert P.VolumeParameters.from_json(params.to_json()).encrypted is True
    assert P.VolumeParameters.from_json(json.dumps({"format": "qcow2"})).encrypted is False


def test_a_key_version_is_a_mutable_parameter_beside_the_limits_and_a_secret_entry() -> None:
    assert P.wanted_key_version({"iopsTotal": "5"}) is None
    assert P.wanted_key_version({"keyVersion": "v2.1_b-3"}) == "v2.1_b-3"
    assert P.parse_mutable_parameters({"keyVersion": "2", "iopsTotal": "5"}) == P.QoS(iops_total=5)
    for bad in ("", "-2", "a b", "x" * 64, "2/3"):
        with pytest.raises(InvalidArgument, match="keyVersion"):
            P.wanted_key_version({"keyVersion": bad})
        if bad:
            with pytest.raises(InvalidArgument, match="controller-modify-secret-name"):
                P.key_version({"keyVersion": bad}, P.CONTROLLER_MODIFY_SECRET)
    with pytest.raises(InvalidArgument, match="supported: .*keyVersion"):
        P.parse_mutable_parameters({"keyVersoin": "2"})
    assert P.key_version({}, P.PROVISIONER_SECRET) == ""
    assert P.previous_key({"previousKey": ""}) is None
    assert P.previous_key({"previousKey": "old"}) == VolumeKey("old")
