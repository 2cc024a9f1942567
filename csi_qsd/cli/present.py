"""What CSI answers look like to a person, and to a script.

`csi-qsd volume …` prints a table with human-readable sizes by default, and
with `-o json` the JSON it has always printed: one object per line, the
protobuf field names as they are, so scripts that read it keep working.
Pure functions of the messages: nothing here calls the driver, and the
table shows only what the CSI answers carry (a volume's name and pool are
the CO's and the catalog's, not in a `Volume`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TypedDict

from google.protobuf import json_format
from google.protobuf.message import Message

from csi_qsd.csi_pb import csi_pb2 as pb

UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
NONE = "-"  # an empty cell
GAP = "   "  # between columns
VOLUME_COLUMNS = ("VOLUME ID", "SIZE", "EXPORT", "FORMAT", "SOURCE")
STATUS_COLUMNS = ("PUBLISHED ON", "CONDITION")
SNAPSHOT_COLUMNS = ("SNAPSHOT ID", "SOURCE VOLUME", "SIZE", "CREATED", "READY", "GROUP")
INFO_COLUMNS = ("DRIVER", "VERSION", "READY", "AVAILABLE")
USAGE_COLUMNS = ("UNIT", "TOTAL", "USED", "AVAILABLE")
SIZE_COLUMNS = {"SIZE", "AVAILABLE", "TOTAL", "USED"}  # right-aligned, so the units line up


class PluginInfo(TypedDict):
    """What `csi-qsd volume info` reports, from GetPluginInfo, Probe and GetCapacity."""

    name: str
    version: str
    ready: bool
    available_bytes: int


def human_size(size: int) -> str:
    """Bytes as a person reads them: `512 B`, `96.0 MiB`, `1.0 GiB` (binary units, one decimal)."""
    if abs(size) < 1024:
        return f"{size} B"
    value, unit = size / 1024, 0
    while abs(round(value, 1)) >= 1024 and unit < len(UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.1f} {UNITS[unit]}"


def table(columns: Sequence[str], rows: Iterable[Sequence[str]], *, right: Collection[str] = SIZE_COLUMNS) -> str:
    """Rows under their column names, each column as wide as its widest cell.

    Columns named in `right` are right-aligned. Each row stays one line:
    whitespace inside a cell (a multi-line message) is folded to single
    spaces, and an empty cell shows as `-`. Raises ValueError for a row
    that has not one cell per column.
    """
    body = []
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(columns)} columns")
        body.append([" ".join(cell.split()) or NONE for cell in row])
    widths = [max(len(cell) for cell in column) for column in zip(columns, *body)]
    lines = []
    for row in [list(columns), *body]:
        cells = [cell.rjust(width) if name in right else cell.ljust(width)
                 for cell, width, name in zip(row, widths, columns)]
        lines.append(GAP.join(cells).rstrip())
    return "\n".join(lines)


def json_line(record: Message | Mapping[str, object]) -> str:
    """One record as one line of JSON: a message with its protobuf field names (int64 as strings, as ever)."""
    if isinstance(record, Message):
        return json.dumps(json_format.MessageToDict(record, preserving_proto_field_name=True))
    return json.dumps(record)


def _source(volume: pb.Volume) -> str:
    if not volume.HasField("content_source"):
        return NONE
    kind = volume.content_source.WhichOneof("type")
    if kind == "snapshot":
        return volume.content_source.snapshot.snapshot_id
    if kind == "volume":
        return volume.content_source.volume.volume_id
    return NONE


def _volume_cells(volume: pb.Volume) -> list[str]:
    context = volume.volume_context
    return [volume.volume_id, human_size(volume.capacity_bytes), context.get("export", ""),
            context.get("format", ""), _source(volume)]


def condition(value: pb.VolumeCondition) -> str:
    return f"abnormal: {value.message}" if value.abnormal else "ok"


def volumes_table(entries: Sequence[pb.ListVolumesResponse.Entry]) -> str:
    """ListVolumes as a table: each volume, the node it is published on and its condition."""
    return table(VOLUME_COLUMNS + STATUS_COLUMNS, [
        _volume_cells(entry.volume) + [", ".join(entry.status.published_node_ids),
                                       condition(entry.status.volume_condition)]
        for entry in entries
    ])


def volume_table(volume: pb.Volume) -> str:
    """One volume (CreateVolume's answer) as a one-row table."""
    return table(VOLUME_COLUMNS, [_volume_cells(volume)])


def _created(snapshot: pb.Snapshot) -> str:
    if not snapshot.HasField("creation_time"):
        return NONE
    when: datetime.datetime = snapshot.creation_time.ToDatetime(tzinfo=datetime.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%SZ")


def snapshots_table(snapshots: Sequence[pb.Snapshot]) -> str:
    return table(SNAPSHOT_COLUMNS, [
        [s.snapshot_id, s.source_volume_id, human_size(s.size_bytes), _created(s),
         "yes" if s.ready_to_use else "no", s.group_snapshot_id]
        for s in snapshots
    ])


def info_table(info: PluginInfo) -> str:
    return table(INFO_COLUMNS, [[info["name"], info["version"], "yes" if info["ready"] else "no",
                                 human_size(info["available_bytes"])]])


def stats_table(stats: pb.NodeGetVolumeStatsResponse) -> str:
    """NodeGetVolumeStats: bytes in human units, inodes as counts, then the volume's condition."""
    rows = []
    for usage in stats.usage:
        unit = pb.VolumeUsage.Unit.Name(usage.unit)
        number = human_size if usage.unit == pb.VolumeUsage.Unit.BYTES else str
        rows.append([unit, number(usage.total), number(usage.used), number(usage.available)])
    text = table(USAGE_COLUMNS, rows)
    if stats.HasField("volume_condition"):
        text += f"\ncondition: {condition(stats.volume_condition)}"
    return text


def capacity_table(volume_id: str, capacity: int) -> str:
    """NodeExpandVolume's answer: the volume's size now."""
    return table(("VOLUME ID", "SIZE"), [[volume_id, human_size(capacity)]])


LEASE_COLUMNS = ("COPY VOLUME", "NODE", "SOURCE", "STATE", "SNAPSHOT", "ADDRESS", "IDLE")


def leases_table(leases: Sequence[Mapping[str, object]]) -> str:
    """The leases a node serves to copies on other nodes: whose, of what, where, and how long since renewed
    (a dropped one stays `revoked`, holding nothing, until its copy's node releases it or its TTL passes)."""
    return table(LEASE_COLUMNS, [[str(lease["copy_volume_id"]), str(lease["node"]), str(lease["source"]),
                                  str(lease["state"]), str(lease["snapshot_id"]) or NONE,
                                  str(lease["address"]) or NONE, f"{float(str(lease['idle_seconds'])):.0f}s"]
                                 for lease in leases])
