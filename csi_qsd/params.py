"""StorageClass parameters: the only keys a CreateVolume may carry, parsed and checked.

Unknown keys are rejected by name so that a typo in a StorageClass fails at
provisioning time instead of silently giving a volume other than the one meant.
Keys the external-provisioner adds itself (`csi.storage.k8s.io/*`) are ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Any

from csi_qsd.errors import InvalidArgument

PROVISIONER_PREFIX = "csi.storage.k8s.io/"


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


MAX_QUEUES = 64
LOGICAL_BLOCK_SIZES = (512, 4096)


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
        for field in dataclasses.fields(cls):
            if field.name not in raw:
                continue
            default = getattr(cls(), field.name)
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
}

VHOST_ONLY_KEYS = frozenset({"numQueues", "logicalBlockSize", "cache", "iothreadPollMaxNs"})
SUPPORTED_KEYS = frozenset(_PARSERS)


def parse_parameters(parameters: Mapping[str, str]) -> VolumeParameters:
    """Parse a CreateVolume's `parameters` map; raise InvalidArgument naming the bad key."""
    kwargs: dict[str, Any] = {}
    for key in sorted(parameters):
        if key.startswith(PROVISIONER_PREFIX):
            continue
        if key not in _PARSERS:
            known = ", ".join(sorted(_PARSERS))
            raise InvalidArgument(f"unknown StorageClass parameter {key!r}; supported: {known}")
        field, parser = _PARSERS[key]
        kwargs[field] = parser(key, parameters[key])
    params = VolumeParameters(**kwargs)
    if params.export is not ExportKind.VHOST_USER_BLK:
        misplaced = sorted(VHOST_ONLY_KEYS & set(parameters))
        if misplaced:
            raise InvalidArgument(
                f"parameter {misplaced[0]!r} applies only to export 'vhost-user-blk'"
            )
    if params.format is ImageFormat.RAW and params.preallocation is Preallocation.METADATA:
        raise InvalidArgument("parameter 'preallocation' 'metadata' applies only to format 'qcow2'")
    return params
