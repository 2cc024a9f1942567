"""What the catalog stores: one frozen record per row of each table, and the states a row moves through.

Records are plain values: reading one twice gives equal records, and a
record changed with `dataclasses.replace` is written back by the `Catalog`
method for its table. Nothing here touches the database.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from pathlib import Path

from csi_qsd.params import DEFAULT_POOL_NAME, QoS, VolumeParameters


class VolumeState(enum.Enum):
    """CREATING and DELETING are intent rows, written before their step; the reconcile finishes or undoes them."""

    CREATING = "creating"
    READY = "ready"
    DELETING = "deleting"


class SnapshotState(enum.Enum):
    """CREATING: a cut under way (the reconcile rolls it forward or back). DELETING: its image is being removed."""

    CREATING = "creating"
    READY = "ready"
    DELETING = "deleting"


class StageState(enum.Enum):
    """STAGING and UNSTAGING are intent rows, written before the step they name."""

    STAGING = "staging"
    STAGED = "staged"
    UNSTAGING = "unstaging"


class PublishState(enum.Enum):
    """PUBLISHING and UNPUBLISHING are intent rows, written before the step they name."""

    PUBLISHING = "publishing"
    PUBLISHED = "published"
    UNPUBLISHING = "unpublishing"


class ExtentState(enum.Enum):
    """What an extent of a device pool holds; every state but USED is kept from new volumes.

    USED: a volume's bytes. SCRUBBING: freed, still holding the last
    tenant's bytes until zeroed. MOVING: the new home of a volume being
    moved, filled but not yet its own (scrubbed if the move is undone).
    RETIRING: a moved volume's old home, which QSD may still read until it
    has switched to the new one (then scrubbed).
    """

    USED = "used"
    SCRUBBING = "scrubbing"
    MOVING = "moving"
    RETIRING = "retiring"


class AccessType(enum.Enum):
    MOUNT = "mount"
    BLOCK = "block"


@dataclasses.dataclass(frozen=True)
class VolumeRecord:
    id: str
    name: str
    capacity: int
    params: VolumeParameters
    image: Path
    state: VolumeState
    created_at: float
    backing: str = ""  # the image the volume's top image is an overlay on ('' = none)
    generation: int = 0  # how many times the top image was replaced by a new overlay
    source: str = ""  # "snapshot:<id>" or "volume:<id>" it was made from
    pool: str = DEFAULT_POOL_NAME  # the pool the volume's images live in
    qos: QoS = QoS()  # I/O limits, the mutable parameters (ControllerModifyVolume changes them)
    image_pending: bool = False  # the image may not be written or on disk yet (`Catalog.add_volume`)
    key_version: str = ""  # an encrypted volume's: the Secret's 'keyVersion' of the key its images open with


@dataclasses.dataclass(frozen=True)
class ExtentRecord:
    """`length` bytes from `start` of device pool `pool`, taken by `volume_id` (kept while it is scrubbed)."""

    pool: str
    start: int
    length: int
    volume_id: str
    state: ExtentState


@dataclasses.dataclass(frozen=True)
class ExtentChoice:
    """Where a new extent goes: `length` bytes from `start`, as picked by the `choose` of `Catalog.take_extent`."""

    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class SnapshotRecord:
    """A frozen image; `hidden` once deleted by the user while other images still depend on it."""

    id: str
    name: str
    source_volume_id: str
    image: Path
    backing: str
    size: int
    created_at: float
    state: SnapshotState
    hidden: bool = False
    group_id: str = ""
    overlay: str = ""  # while CREATING: the new top image the source volume moves to


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """A group snapshot; its members are the snapshots whose `group_id` is `id`."""

    id: str
    name: str
    created_at: float


@dataclasses.dataclass(frozen=True)
class StageRecord:
    volume_id: str
    staging_path: Path
    access_type: AccessType
    fs_type: str
    mount_flags: tuple[str, ...]
    mount_group: str
    state: StageState
    loop_device: str = ""
    shard: int = 0  # the node's QSD that serves the volume while it is staged (`csi_qsd.qsd.shards`)


@dataclasses.dataclass(frozen=True)
class PublishRecord:
    target_path: Path
    volume_id: str
    readonly: bool
    mount_flags: tuple[str, ...]
    state: PublishState
    loop_device: str = ""
    single_writer: bool = False  # published with SINGLE_NODE_SINGLE_WRITER: no other target allowed


class CopyRole(enum.Enum):
    """Which end of a cross-node copy a row records."""

    TARGET = "target"  # this node's volume is filled from another node's snapshot
    SOURCE = "source"  # this node serves one of its snapshots to a copy on another node (a read lease)


class CopyState(enum.Enum):
    """TARGET: LEASING (asking the source), STREAMING (usable, being made local), RELEASING (whole; lease to drop),
    LOST (the source dropped the lease before the copy was whole: what was not copied is gone).
    SOURCE: SERVING (the snapshot is exported for the copy), REVOKED (an operator dropped the lease: the copy may
    not have it again; the row, holding nothing, goes when the copy's node releases it or after the lease TTL)."""

    LEASING = "leasing"
    STREAMING = "streaming"
    RELEASING = "releasing"
    LOST = "lost"
    SERVING = "serving"
    REVOKED = "revoked"


@dataclasses.dataclass(frozen=True)
class CopyRecord:
    """One end of a copy of a snapshot from one node to another.

    `volume_id` is the copy (the volume on the target node) at both ends;
    `node` the other end's node; `source` what the CreateVolume named
    ("snapshot:<id>" or "volume:<id>"); `snapshot_id` the source node's
    snapshot served; `address` host:port of its NBD server; `image` on the
    target the local copy image being filled, on the source the image served.
    """

    volume_id: str
    role: CopyRole
    node: str
    source: str
    state: CopyState
    created_at: float
    snapshot_id: str = ""
    address: str = ""
    image: str = ""


def now() -> float:
    """The time a record is created at (`created_at`): seconds since the epoch."""
    return time.time()
