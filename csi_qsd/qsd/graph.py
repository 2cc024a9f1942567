"""The node-name scheme and the blockdev/export JSON the driver sends to QSD.

Pure functions: given a volume, say which nodes and exports it needs. Names
derive from the volume ID, so a restarted driver can tell its own nodes from
anything else in the graph.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from csi_qsd.params import CacheMode, ImageFormat, QoS, VolumeParameters
from csi_qsd.validate import VOLUME_ID_RE

IOTHREAD_ID = "iothread0"
# Per-volume qcow2 metadata cache: bounded on purpose (default would grow to 32 MiB each).
L2_CACHE_BYTES = 1 << 20
# QEMU caps node names at 31 characters: "cq" + 24 hex digits + "-q" + 3 base-36
# digits of the image generation fits exactly.
NODE_PREFIX = "cq"
MAX_GENERATION = 36**3 - 1

QMPArgs = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class VolumeNodes:
    """The QSD names belonging to one volume."""

    file: str
    format: str
    fuse_export: str
    vhost_export: str
    throttle: str  # the filter every export sits on; outlives generations (blockdev-snapshot swaps its child)
    size_guard: str  # a fixed-size raw node over the throttle filter: what a growable FUSE export stands on
    throttle_group: str  # the object holding the volume's limits
    move_job: str  # the block job that moves the volume to a new home (`csi_qsd.qsd.move`)
    secret: str  # an encrypted volume's key, only while QSD opens its layers (`csi_qsd.qsd.encryption`)
    link: str  # + 1, 2, ...: the older layers another node serves under a copy's link (`csi_qsd.qsd.encryption`)


_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(number: int) -> str:
    digits = _BASE36
    if not 0 <= number <= MAX_GENERATION:
        raise ValueError(f"image generation {number} out of range")
    out = ""
    while True:
        number, rest = divmod(number, 36)
        out = digits[rest] + out
        if not number:
            return out


def nodes_for(volume_id: str, generation: int = 0) -> VolumeNodes:
    """Names for a volume's top image of `generation` (a snapshot moves the top to generation+1)."""
    suffix = volume_id.removeprefix("vol-")
    gen = _base36(generation)
    return VolumeNodes(
        file=f"{NODE_PREFIX}{suffix}-f{gen}",
        format=f"{NODE_PREFIX}{suffix}-q{gen}",
        fuse_export=f"{NODE_PREFIX}{suffix}-fuse",
        vhost_export=f"{NODE_PREFIX}{suffix}-vhost",
        throttle=f"{NODE_PREFIX}{suffix}-t",
        size_guard=f"{NODE_PREFIX}{suffix}-g",
        throttle_group=f"{NODE_PREFIX}{suffix}-tg",
        move_job=f"{NODE_PREFIX}{suffix}-mv",
        secret=f"{NODE_PREFIX}{suffix}-k",
        link=f"{NODE_PREFIX}{suffix}-l",
    )


class NameKind(enum.Enum):
    """What one of our QSD names stands for (the part after the last dash)."""

    FILE = "f"
    FORMAT = "q"
    FUSE_EXPORT = "fuse"
    VHOST_EXPORT = "vhost"
    IOTHREAD = "io"
    THROTTLE = "t"
    THROTTLE_GROUP = "tg"
    SIZE_GUARD = "g"


@dataclasses.dataclass(frozen=True)
class ParsedName:
    """One of our node, export or iothread names, decoded; `generation` only for file and format nodes."""

    volume_id: str
    kind: NameKind
    generation: int | None = None


def parse_name(name: str) -> ParsedName | None:
    """Decode a name from QSD's graph; None if it is not one of ours.

    The one place that knows the scheme `nodes_for` writes: every other
    module asks here instead of splitting names itself, so the scheme can
    change in one file.
    """
    volume_id = volume_of(name)
    if volume_id is None:
        return None
    tail = name.rpartition("-")[2]
    for kind in (NameKind.FUSE_EXPORT, NameKind.VHOST_EXPORT, NameKind.IOTHREAD, NameKind.THROTTLE,
                 NameKind.THROTTLE_GROUP, NameKind.SIZE_GUARD):
        if tail == kind.value:
            return ParsedName(volume_id, kind)
    layers = {NameKind.FILE.value: NameKind.FILE, NameKind.FORMAT.value: NameKind.FORMAT}
    layer = layers.get(tail[:1])
    digits = tail[1:]
    if layer is None or not digits or not all(c in _BASE36 for c in digits):
        return None
    generation = int(digits, 36)
    if generation > MAX_GENERATION:
        return None
    return ParsedName(volume_id, layer, generation)


def format_generations(names: Iterable[str], volume_id: str) -> list[int]:
    """Generations of `volume_id`'s format nodes among `names`, newest first."""
    found = set()
    for name in names:
        parsed = parse_name(name)
        if parsed is not None and parsed.volume_id == volume_id and parsed.kind is NameKind.FORMAT:
            assert parsed.generation is not None
            found.add(parsed.generation)
    return sorted(found, reverse=True)


def volume_node_names(names: Iterable[str], volume_id: str) -> set[str]:
    """The names among `names` that belong to `volume_id`."""
    return {name for name in names if volume_of(name) == volume_id}


def format_node_over(file_node: str) -> str | None:
    """The name of the format node that our scheme puts over our file node `file_node`, else None."""
    parsed = parse_name(file_node)
    if parsed is None or parsed.kind is not NameKind.FILE or parsed.generation is None:
        return None
    return nodes_for(parsed.volume_id, parsed.generation).format


def volume_of(node_or_export: str) -> str | None:
    """Map one of our node or export names back to its volume ID; None if not ours."""
    if not node_or_export.startswith(NODE_PREFIX):
        return None
    body = node_or_export[len(NODE_PREFIX):]
    suffix, dash, kind = body.partition("-")
    candidate = f"vol-{suffix}"
    return candidate if dash and kind and VOLUME_ID_RE.match(candidate) else None


# QSD's monitor reads QMP input one byte per system call (measured on 10.0.13: ~3 us a byte), so a
# command's length is most of its cost: the builders below leave out every option at QEMU's default
# (file: aio=threads, cache.direct=off, cache.no-flush=off; any node: read-only=off, detect-zeroes=off).


def file_blockdev(
    nodes: VolumeNodes | None, image: Path, params: VolumeParameters, *, read_only: bool, aio: str = "threads",
    direct: bool = False,
) -> QMPArgs:
    """A file protocol node: I/O by `aio` (`csi_qsd.qsd.file_aio`), through the page cache unless `direct`,
    flushes reaching the disk.

    Without `nodes`, an unnamed one, to be defined inside its format node's arguments.
    """
    name = {"node-name": nodes.file} if nodes is not None else {}
    spec: QMPArgs = {"driver": "file", **name, "filename": str(image), "discard": params.discard.value}
    if aio != "threads":
        spec["aio"] = aio
    if direct:
        spec["cache"] = {"direct": True}
    return _read_only(spec, read_only)


def format_blockdev(nodes: VolumeNodes, params: VolumeParameters, *, read_only: bool) -> QMPArgs:
    spec: QMPArgs = {
        "driver": params.format.value,
        "node-name": nodes.format,
        "file": nodes.file,
        "discard": params.discard.value,
    }
    if params.detect_zeroes.value != "off":
        spec["detect-zeroes"] = params.detect_zeroes.value
    if params.format is ImageFormat.QCOW2:
        spec["l2-cache-size"] = L2_CACHE_BYTES
    return _read_only(spec, read_only)


def _read_only(spec: QMPArgs, read_only: bool) -> QMPArgs:
    if read_only:
        spec["read-only"] = True
    return spec


def overlay_blockdev(nodes: VolumeNodes, params: VolumeParameters) -> QMPArgs:
    """A new top image's format node, opened without its backing: blockdev-snapshot attaches it."""
    spec = format_blockdev(nodes, params, read_only=False)
    spec["driver"] = ImageFormat.QCOW2.value
    spec["l2-cache-size"] = L2_CACHE_BYTES
    spec["backing"] = None
    return spec


def fuse_export(
    nodes: VolumeNodes, mountpoint: Path, *, writable: bool, iothreads: list[str] | None = None, io_uring: bool = False,
    growable: bool = False,
) -> QMPArgs:
    """The export's arguments; with `iothreads` (QEMU >= 11) one /dev/fuse queue per thread, else QSD's main loop;
    `io_uring` where QSD's export and the kernel offer FUSE over io_uring (`csi_qsd.qsd.fuse_paths`).

    A `growable` export (QEMU 11 asks the kernel for FUSE_ASYNC_DIO only for
    one) stands on the volume's size guard, not on the throttle filter: a
    growable export would let a write past the end, a truncate or an open
    with O_TRUNC (no longer atomic there) change the image's size; through
    a raw node of fixed size each is refused and nothing changes.
    """
    spec: QMPArgs = {
        "type": "fuse",
        "id": nodes.fuse_export,
        "node-name": nodes.size_guard if growable else nodes.throttle,
        "mountpoint": str(mountpoint),
        "writable": writable,
        "allow-other": "off",
    }
    if growable:
        spec["growable"] = True
    if iothreads:
        spec["iothread"] = list(iothreads)
    if io_uring:
        spec["io-uring"] = True
    return spec


def throttle_limits(qos: QoS) -> QMPArgs:
    """QEMU's ThrottleLimits for `qos`, every field given: a `qom-set` changes only the fields it names."""
    limits: QMPArgs = {}
    for kind in ("iops", "bps"):
        for scope in ("total", "read", "write"):
            rate = getattr(qos, f"{kind}_{scope}")
            burst = getattr(qos, f"{kind}_{scope}_max")
            limits[f"{kind}-{scope}"] = rate
            limits[f"{kind}-{scope}-max"] = burst
            # QEMU refuses a burst length without a burst rate.
            limits[f"{kind}-{scope}-max-length"] = qos.burst_seconds if burst else 1
    return limits


def throttle_group_object(nodes: VolumeNodes, qos: QoS) -> QMPArgs:
    """`object-add` arguments for the volume's throttle group, holding its limits.

    A new group starts from QEMU's defaults (no limit, bursts of one
    second), so only the fields that differ are sent.
    """
    limits = {key: value for key, value in throttle_limits(qos).items()
              if value != (1 if key.endswith("-max-length") else 0)}
    spec: QMPArgs = {"qom-type": "throttle-group", "id": nodes.throttle_group}
    if limits:
        spec["limits"] = limits
    return spec


def throttle_blockdev(nodes: VolumeNodes) -> QMPArgs:
    """The throttle filter over the volume's top format node; exports sit on it, so limits hold for all of them."""
    return {"driver": "throttle", "node-name": nodes.throttle, "throttle-group": nodes.throttle_group,
            "file": nodes.format}


def size_guard_blockdev(nodes: VolumeNodes, size: int | None) -> QMPArgs:
    """The raw node over the throttle filter that holds a growable FUSE export to `size` bytes.

    Without `size` it follows the filter's length and lets a resize through
    (a raw node of fixed size shares no RESIZE permission): `attach.resize`
    lifts it for the resize and sets it again after.
    """
    spec: QMPArgs = {"driver": "raw", "node-name": nodes.size_guard, "file": nodes.throttle}
    if size is not None:
        spec["size"] = size
    return spec


def iothread_for(nodes: VolumeNodes, params: VolumeParameters, pool_thread: str = IOTHREAD_ID) -> str:
    """The pool's thread given, or the volume's own when it asks for its own polling budget."""
    if params.iothread_poll_max_ns is None:
        return pool_thread
    return own_iothread_id(nodes)


def own_iothread_id(nodes: VolumeNodes) -> str:
    return nodes.vhost_export.removesuffix("-vhost") + "-io"


def iothread_object(nodes: VolumeNodes, params: VolumeParameters) -> QMPArgs | None:
    """`object-add` arguments for the volume's own iothread, or None when it uses the shared one."""
    if params.iothread_poll_max_ns is None:
        return None
    return {"qom-type": "iothread", "id": iothread_for(nodes, params), "poll-max-ns": params.iothread_poll_max_ns}


def vhost_user_blk_export(
    nodes: VolumeNodes, socket: Path, params: VolumeParameters, *, writable: bool,
    pool_thread: str | None = IOTHREAD_ID,
) -> QMPArgs:
    """The export's arguments: in `pool_thread` (or the volume's own iothread), or QSD's main loop for None."""
    spec: QMPArgs = {
        "type": "vhost-user-blk",
        "id": nodes.vhost_export,
        "node-name": nodes.throttle,
        "addr": {"type": "unix", "path": str(socket)},
        "writable": writable,
        # The guest sees a write-through cache and never flushes; only this keeps
        # acknowledged writes through a QSD crash.
        "writethrough": params.cache is CacheMode.WRITETHROUGH,
        "num-queues": params.num_queues,
        "logical-block-size": params.logical_block_size,
    }
    if pool_thread is not None:
        spec["iothread"] = iothread_for(nodes, params, pool_thread)
    return spec
