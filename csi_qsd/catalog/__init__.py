"""The SQLite catalog: the source of truth for volumes, snapshots, stages, publishes, extents and copies.

`records` holds what a row is (frozen records and their states), `schema`
the tables and the steps that bring an older catalog to them, `rows` the one
statement that writes each kind of record and the parse of each row,
`store` the `Catalog` (one verb per act on a table's rows), and
`connection` the one connection under it: transactions, durability, and
when I/O leaves the event loop. Callers import from here. This package knows nothing of QSD,
mounts or gRPC.

May import: errors, params.
"""

from csi_qsd.catalog.records import (
    AccessType,
    CopyRecord,
    CopyRole,
    CopyState,
    ExtentChoice,
    ExtentRecord,
    ExtentState,
    GroupRecord,
    PublishRecord,
    PublishState,
    SnapshotRecord,
    SnapshotState,
    StageRecord,
    StageState,
    VolumeRecord,
    VolumeState,
    now,
)
from csi_qsd.catalog.schema import SCHEMA_VERSION
from csi_qsd.catalog.store import Catalog

__all__ = [
    "SCHEMA_VERSION", "AccessType", "Catalog", "CopyRecord", "CopyRole", "CopyState", "ExtentChoice",
    "ExtentRecord", "ExtentState", "GroupRecord", "PublishRecord", "PublishState", "SnapshotRecord",
    "SnapshotState", "StageRecord", "StageState", "VolumeRecord", "VolumeState", "now",
]
