"""StorageClass parameters: the only keys a CreateVolume may carry, parsed and checked.

Unknown keys are rejected by name so that a typo in a StorageClass fails at
provisioning time instead of silently giving a volume other than the one meant.
Keys the external-provisioner adds itself (`csi.storage.k8s.io/*`) are ignored.

The rest of a request's vocabulary lives here too, stripped of gRPC, for the
controller side, the node side and the CSI layer alike: access modes and
capabilities (`Capability`, `unsupported_capability`), and the size a CSI
capacity range gives (`choose_size`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Mapping
from typing import Any

from csi_qsd.errors import InvalidArgument, OutOfRange
from csi_qsd.qcow2.granularity import DEFAULT as DEFAULT_GRANULARITY
from csi_qsd.qcow2.granularity import parse as parse_granularity
from csi_qsd.sys.volume_keys import VolumeKey

PROVISIONER_PREFIX = "csi.storage.k8s.io/"
# The claim's namespace, which the external-provisioner adds with --extra-create-metadata.
NAMESPACE_KEY = PROVISIONER_PREFIX + "pvc/namespace"


class ImageFormat(enum.Enum):
    QCOW2 = "qcow2"
    RAW = "raw"


class Preallocation(enum.Enum):
    OFF = "off"
    METADATA = "metadata"
    FALLOC = "falloc"
    FULL = "full"


class ExportKind(enum.Enum):
    FILESYSTEM = "filesystem"
    VHOST_USER_BLK = "vhost-user-blk"


class CacheMode(enum.Enum):
    """writethrough: every write reaches the image before it is acknowledged (safe default)."""

    WRITETHROUGH = "writethrough"
    WRITEBACK = "writeback"


class Discard(enum.Enum):
    UNMAP = "unmap"
    IGNORE = "ignore"


class DetectZeroes(enum.Enum):
    OFF = "off"
    ON = "on"
    UNMAP = "unmap"


DEFAULT_POOL_NAME = "default"
# Pool names become QSD node names ("dp-" + name, at most 31 characters) and label text.
POOL_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,27}\Z")
MAX_QUEUES = 64
LOGICAL_BLOCK_SIZES = (512, 4096)
MAX_GID = 4294967294  # (gid_t)-1 means "no change" to chown


@dataclasses.dataclass(frozen=True)
class VolumeParameters:
    """What a StorageClass chose for a volume; stored with it in the catalog."""

    format: ImageFormat = ImageFormat.QCOW2
    preallocation: Preallocation = Preallocation.OFF
    export: ExportKind = ExportKind.FILESYSTEM
    # QEMU gives a vhost-user-blk-pci device one queue per vCPU and refuses a backend
    # offering fewer; unused queues cost QSD about nothing, so offer the most.
    num_queues: int = 64
    logical_block_size: int = 512
    cache: CacheMode = CacheMode.WRITETHROUGH
    discard: Discard = Discard.UNMAP
    detect_zeroes: DetectZeroes = DetectZeroes.OFF
    iothread_poll_max_ns: int | None = None
    # The group of the VMM that opens the vhost-user-blk socket (a numeric GID); "" leaves it to
    # volume_mount_group. Hotplug needs it: the pod that mounts the volume is not the VM's.
    vmm_group: str = ""
    # The pool the volume lives in: "default" is the file pool, any other name a device pool.
    pool: str = DEFAULT_POOL_NAME
    # Changed-block granularity in bytes: the qcow2 (sub)cluster of every image of the volume's chain.
    granularity: int = DEFAULT_GRANULARITY
    # The claim's namespace (from the provisioner, not the StorageClass): a node with several QSD shards
    # serves one namespace's volumes from one shard, so a VolumeGroupSnapshot (namespaced) is cut in one
    # transaction. Not part of what makes two requests the same volume.
    namespace: str = dataclasses.field(default="", compare=False)
    # Every image of the volume is a qcow2 with LUKS encryption (`encrypt.format=luks`), keyed by a Secret.
    encrypted: bool = False

    def to_json(self) -> str:
        raw: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            raw[field.name] = value.value if isinstance(value, enum.Enum) else value
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "VolumeParameters":
        raw = json.loads(text)
        kwargs: dict[str, Any] = {}
        defaults = cls()
        for field in dataclasses.fields(cls):
            if field.name not in raw:
                continue
            default = getattr(defaults, field.name)
            value = raw[field.name]
            kwargs[field.name] = type(default)(value) if isinstance(default, enum.Enum) else value
        return cls(**kwargs)


def _enum(key: str, value: str, kind: type[enum.Enum]) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in kind)
        raise InvalidArgument(f"parameter {key!r} has value {value!r}; allowed: {allowed}") from None


def _integer(key: str, value: str, allowed: range | tuple[int, ...]) -> int:
    # Plain ASCII digits only: int() would also take ' 5', '+5', '5_0' or '٥'.
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        raise InvalidArgument(f"parameter {key!r} must be a non-negative integer, got {value!r}")
    number = int(value, 10)
    if number not in allowed:
        shown = f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else str(list(allowed))
        raise InvalidArgument(f"parameter {key!r} is {number}; allowed: {shown}")
    return number


def _boolean(key: str, value: str) -> bool:
    if value not in ("true", "false"):
        raise InvalidArgument(f"parameter {key!r} is {value!r}; allowed: 'true', 'false'")
    return value == "true"


def pool_name(key: str, value: str) -> str:
    if not POOL_NAME_RE.match(value):
        raise InvalidArgument(
            f"parameter {key!r} is {value!r}; a pool name is a lower-case letter, then up to 27 of [a-z0-9-]"
        )
    return value


# key -> (dataclass field, parser)
_PARSERS: dict[str, tuple[str, Any]] = {
    "format": ("format", lambda k, v: _enum(k, v, ImageFormat)),
    "preallocation": ("preallocation", lambda k, v: _enum(k, v, Preallocation)),
    "export": ("export", lambda k, v: _enum(k, v, ExportKind)),
    "numQueues": ("num_queues", lambda k, v: _integer(k, v, range(1, MAX_QUEUES + 1))),
    "logicalBlockSize": ("logical_block_size", lambda k, v: _integer(k, v, LOGICAL_BLOCK_SIZES)),
    "cache": ("cache", lambda k, v: _enum(k, v, CacheMode)),
    "discard": ("discard", lambda k, v: _enum(k, v, Discard)),
    "detectZeroes": ("detect_zeroes", lambda k, v: _enum(k, v, DetectZeroes)),
    "iothreadPollMaxNs": ("iothread_poll_max_ns", lambda k, v: _integer(k, v, range(0, 1_000_001))),
    "vmmGroup": ("vmm_group", lambda k, v: str(_integer(k, v, range(1, MAX_GID + 1)))),
    "pool": ("pool", pool_name),
    "changedBlockGranularity": ("granularity", parse_granularity),
    "encrypted": ("encrypted", _boolean),
}

VHOST_ONLY_KEYS = frozenset({"numQueues", "logicalBlockSize", "cache", "iothreadPollMaxNs", "vmmGroup"})


def parse_parameters(parameters: Mapping[str, str]) -> VolumeParameters:
    """Parse a CreateVolume's `parameters` map; raise InvalidArgument naming the bad key."""
    kwargs: dict[str, Any] = {}
    for key in sorted(parameters):
        if key == NAMESPACE_KEY:
            kwargs["namespace"] = parameters[key]
            continue
        if key.startswith(PROVISIONER_PREFIX):
            continue
        if key in QOS_KEYS:
            raise InvalidArgument(
                f"parameter {key!r} is a mutable parameter: set I/O limits in a VolumeAttributesClass "
                "(CreateVolume's or ControllerModifyVolume's mutable_parameters), not in the StorageClass"
            )
        if key not in _PARSERS:
            known = ", ".join(sorted(_PARSERS))
            raise InvalidArgument(f"unknown StorageClass parameter {key!r}; supported: {known}")
        field, parser = _PARSERS[key]
        kwargs[field] = parser(key, parameters[key])
    if kwargs.get("pool", DEFAULT_POOL_NAME) != DEFAULT_POOL_NAME and "format" not in kwargs:
        kwargs["format"] = ImageFormat.RAW  # a device pool's volumes are raw extents
    params = VolumeParameters(**kwargs)
    if params.export is not ExportKind.VHOST_USER_BLK:
        misplaced = sorted(VHOST_ONLY_KEYS & set(parameters))
        if misplaced:
            raise InvalidArgument(
                f"parameter {misplaced[0]!r} applies only to export 'vhost-user-blk'"
            )
    if params.format is ImageFormat.RAW and "changedBlockGranularity" in parameters:
        raise InvalidArgument(
            "parameter 'changedBlockGranularity' applies only to format 'qcow2': raw volumes (every volume of "
            "a device pool is one) have no snapshots to track changes between"
        )
    if params.encrypted and (params.format is not ImageFormat.QCOW2 or params.pool != DEFAULT_POOL_NAME):
        raise InvalidArgument("parameter 'encrypted' applies only to format 'qcow2' in the file pool "
                              "(pool 'default'): QEMU encrypts qcow2 images with LUKS")
    if params.format is ImageFormat.RAW and params.preallocation is Preallocation.METADATA:
        raise InvalidArgument("parameter 'preallocation' 'metadata' applies only to format 'qcow2'")
    return params


# ---------------------------------------------------------------- keys of encrypted volumes

# The entry of the Secret that holds an encrypted volume's passphrase: what the sidecars pass in `secrets`.
SECRET_KEY = "key"
# Where each call's Secret is named, in the StorageClass (or VolumeSnapshotClass), for the errors.
PROVISIONER_SECRET = PROVISIONER_PREFIX + "provisioner-secret-name"
NODE_STAGE_SECRET = PROVISIONER_PREFIX + "node-stage-secret-name"
SNAPSHOTTER_SECRET = PROVISIONER_PREFIX + "snapshotter-secret-name"
CONTROLLER_MODIFY_SECRET = PROVISIONER_PREFIX + "controller-modify-secret-name"
# Key rotation: the Secret's label for the key in `SECRET_KEY` (recorded per volume), the key a volume had before
# (stages and rotations of volumes the rotation has not reached yet use it), and the mutable parameter (in a
# VolumeAttributesClass) that asks ControllerModifyVolume to bring a volume to a key version.
KEY_VERSION = "keyVersion"
PREVIOUS_KEY = "previousKey"
_KEY_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


def volume_key(secrets: Mapping[str, str], what: str, secret: str) -> VolumeKey:
    """The passphrase of encrypted volume `what` from a request's CSI `secrets`; `secret` is the parameter that
    names the Secret it comes from. Raises InvalidArgument (never showing a value) when it is missing or empty."""
    text = secrets.get(SECRET_KEY, "")
    if not text:
        carried = ", ".join(repr(k) for k in sorted(secrets)) or "none"
        raise InvalidArgument(
            f"{what} is encrypted: its passphrase must come in entry {SECRET_KEY!r} of the Secret named by "
            f"{secret!r}; the request carries {'an empty one' if SECRET_KEY in secrets else 'no such entry'} "
            f"(entries: {carried})")
    return VolumeKey(text)


def previous_key(secrets: Mapping[str, str]) -> VolumeKey | None:
    """The key a volume had before a rotation (entry `previousKey`), if the Secret still carries one."""
    text = secrets.get(PREVIOUS_KEY, "")
    return VolumeKey(text) if text else None


def key_version(secrets: Mapping[str, str], secret: str) -> str:
    """The Secret's `keyVersion` ('' if it has none); raises InvalidArgument, naming `secret`, for a malformed one."""
    version = secrets.get(KEY_VERSION, "")
    if version and not _KEY_VERSION_RE.match(version):
        raise InvalidArgument(f"entry {KEY_VERSION!r} of the Secret named by {secret!r} is {version!r}: a key version "
                              "is 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return version


def wanted_key_version(mutable: Mapping[str, str]) -> str | None:
    """The key version a VolumeAttributesClass asks for (mutable parameter `keyVersion`), or None."""
    if KEY_VERSION not in mutable:
        return None
    version = mutable[KEY_VERSION]
    if not _KEY_VERSION_RE.match(version):
        raise InvalidArgument(f"mutable parameter {KEY_VERSION!r} is {version!r}: a key version is 1-63 letters, "
                              "digits, '.', '_' or '-', starting with a letter or digit")
    return version


# ---------------------------------------------------------------- mutable parameters: QoS

# QEMU refuses a throttle value above this (THROTTLE_VALUE_MAX), and a burst whose rate x length exceeds it.
QOS_VALUE_MAX = 10**15
MAX_BURST_SECONDS = 86400


@dataclasses.dataclass(frozen=True)
class QoS:
    """A volume's I/O limits: per second, 0 for none; changed live by ControllerModifyVolume.

    `*_max` is the burst rate a volume may reach for `burst_seconds` after it
    stayed below its limit; QEMU's throttle filter enforces all of them in
    QSD, above the image, so every export of the volume is held to them.
    Stored in the catalog's `qos` column, apart from the fixed parameters.
    """

    iops_total: int = 0
    iops_read: int = 0
    iops_write: int = 0
    bps_total: int = 0
    bps_read: int = 0
    bps_write: int = 0
    iops_total_max: int = 0
    iops_read_max: int = 0
    iops_write_max: int = 0
    bps_total_max: int = 0
    bps_read_max: int = 0
    bps_write_max: int = 0
    burst_seconds: int = 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "QoS":
        raw = json.loads(text) if text else {}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in raw.items() if k in names})


# mutable parameter key -> QoS field; the keys a VolumeAttributesClass may carry.
QOS_KEYS: dict[str, str] = {
    "iopsTotal": "iops_total", "iopsRead": "iops_read", "iopsWrite": "iops_write",
    "bpsTotal": "bps_total", "bpsRead": "bps_read", "bpsWrite": "bps_write",
    "iopsTotalMax": "iops_total_max", "iopsReadMax": "iops_read_max", "iopsWriteMax": "iops_write_max",
    "bpsTotalMax": "bps_total_max", "bpsReadMax": "bps_read_max", "bpsWriteMax": "bps_write_max",
    "burstSeconds": "burst_seconds",
}
_QOS_KEY_OF = {field: key for key, field in QOS_KEYS.items()}


def parse_mutable_parameters(mutable: Mapping[str, str], current: QoS = QoS()) -> QoS:
    """Apply a CreateVolume's or ControllerModifyVolume's `mutable_parameters` to `current`.

    Only the keys given change (the CSI spec: nothing is modified for an
    absent key), so lifting a limit takes an explicit "0". The result must
    make sense as a whole, as QEMU would refuse it otherwise: a total limit
    excludes read/write limits of the same kind, and a burst rate needs a
    limit no higher than itself. Raises InvalidArgument naming the key.
    """
    changes = check_mutable_keys(mutable)
    qos = dataclasses.replace(current, **changes)
    _check_qos(qos, set(changes))
    return qos


def check_mutable_keys(mutable: Mapping[str, str]) -> dict[str, int]:
    """Each key known and each value well-formed, on its own (QoS field -> value); raises InvalidArgument.

    What the keys mean together depends on the volume's current limits, so
    that is checked only once they are merged (`parse_mutable_parameters`).
    """
    changes: dict[str, int] = {}
    for key in sorted(mutable):
        if key.startswith(PROVISIONER_PREFIX) or key == KEY_VERSION:
            continue
        if key not in QOS_KEYS:
            known = ", ".join(sorted([*QOS_KEYS, KEY_VERSION]))
            raise InvalidArgument(f"unknown mutable parameter {key!r}; supported: {known}")
        allowed = range(1, MAX_BURST_SECONDS + 1) if key == "burstSeconds" else range(0, QOS_VALUE_MAX + 1)
        changes[QOS_KEYS[key]] = _integer(key, mutable[key], allowed)
    return changes


def _check_qos(qos: QoS, given: set[str]) -> None:
    def key(field: str) -> str:
        return _QOS_KEY_OF[field]

    def blame(*fields: str) -> str:
        """The key to name: one the request gave, if any did."""
        return key(next((f for f in fields if f in given), fields[0]))

    for kind in ("iops", "bps"):
        total = f"{kind}_total"
        for side in ("read", "write"):
            part = f"{kind}_{side}"
            for a, b in ((total, part), (f"{total}_max", f"{part}_max")):
                if getattr(qos, a) and getattr(qos, b):
                    named = blame(b, a)
                    other = key(a) if named == key(b) else key(b)
                    raise InvalidArgument(
                        f"mutable parameter {named!r} cannot be combined with {other!r}: limit either {kind} "
                        "in total or reads and writes apart (set the other to \"0\")"
                    )
        for scope in ("total", "read", "write"):
            rate, burst = f"{kind}_{scope}", f"{kind}_{scope}_max"
            if not getattr(qos, burst):
                continue
            if not getattr(qos, rate):
                raise InvalidArgument(f"mutable parameter {blame(burst, rate)!r}: a burst rate {key(burst)!r} "
                                      f"needs a limit {key(rate)!r}")
            if getattr(qos, burst) < getattr(qos, rate):
                raise InvalidArgument(f"mutable parameter {blame(burst, rate)!r}: burst rate {key(burst)!r} "
                                      f"({getattr(qos, burst)}) must be at least the limit {key(rate)!r} "
                                      f"({getattr(qos, rate)})")
            if getattr(qos, burst) * qos.burst_seconds > QOS_VALUE_MAX:
                raise InvalidArgument(f"mutable parameter {blame('burst_seconds', burst)!r}: {key(burst)!r} x "
                                      f"'burstSeconds' must not exceed {QOS_VALUE_MAX}")


# What a request asks besides its parameters: capabilities and a capacity range.

MIB = 1 << 20
GIB = 1 << 30
SIZE_GRANULARITY = MIB
DEFAULT_SIZE = GIB


class AccessMode(enum.Enum):
    """The CSI access modes; only single-node ones can be served by node-local storage."""

    SINGLE_NODE_WRITER = "SINGLE_NODE_WRITER"
    SINGLE_NODE_READER_ONLY = "SINGLE_NODE_READER_ONLY"
    SINGLE_NODE_SINGLE_WRITER = "SINGLE_NODE_SINGLE_WRITER"
    SINGLE_NODE_MULTI_WRITER = "SINGLE_NODE_MULTI_WRITER"
    MULTI_NODE_READER_ONLY = "MULTI_NODE_READER_ONLY"
    MULTI_NODE_SINGLE_WRITER = "MULTI_NODE_SINGLE_WRITER"
    MULTI_NODE_MULTI_WRITER = "MULTI_NODE_MULTI_WRITER"
    UNKNOWN = "UNKNOWN"


SUPPORTED_ACCESS_MODES = frozenset({
    AccessMode.SINGLE_NODE_WRITER, AccessMode.SINGLE_NODE_READER_ONLY,
    AccessMode.SINGLE_NODE_SINGLE_WRITER, AccessMode.SINGLE_NODE_MULTI_WRITER,
})


@dataclasses.dataclass(frozen=True)
class Capability:
    """One requested volume capability, stripped of gRPC."""

    block: bool
    fs_type: str
    mode: AccessMode


def unsupported_capability(cap: Capability, params: VolumeParameters | None) -> str | None:
    """Why `cap` cannot be served (for a volume with `params`), or None if it can."""
    if cap.mode not in SUPPORTED_ACCESS_MODES:
        return f"access mode {cap.mode.value} is not supported: volumes are node-local (use a SINGLE_NODE_* mode)"
    if cap.fs_type and cap.fs_type not in ("ext4", "xfs"):
        return f"fs_type {cap.fs_type!r} is not supported (use ext4 or xfs)"
    if params is not None and params.export is ExportKind.VHOST_USER_BLK and cap.block:
        return "a vhost-user-blk volume is published as a directory holding its socket: use the mount access type"
    return None


def choose_size(required: int, limit: int) -> int:
    """The size to give a volume for a CSI capacity range (0 means unset), rounded to 1 MiB."""
    if required < 0 or limit < 0:
        raise OutOfRange("capacity_range bytes must not be negative")
    if limit and required > limit:
        raise OutOfRange(f"required_bytes {required} exceeds limit_bytes {limit}")
    if required:
        size = -(-required // SIZE_GRANULARITY) * SIZE_GRANULARITY
    else:
        size = DEFAULT_SIZE
    if limit and size > limit:
        size = (limit // SIZE_GRANULARITY) * SIZE_GRANULARITY
        if size < max(required, 1):
            raise OutOfRange(
                f"no size in [{required}, {limit}] is a multiple of the {SIZE_GRANULARITY}-byte granularity"
            )
    return size


SIZE_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_SIZE_RE = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti)?\Z")


def parse_size(text: str) -> int:
    """Bytes, or a whole number with Ki, Mi, Gi or Ti (as the command line and `--managed-pool` spell sizes);
    ValueError otherwise."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"{text!r}: expected bytes, or a number with Ki, Mi, Gi or Ti")
    return int(match.group(1)) * SIZE_UNITS[match.group(2) or ""]
