"""cli/present: the tables `csi-qsd volume …` prints for people, and the JSON lines it prints for scripts."""

from __future__ import annotations

import json

import pytest
from google.protobuf import timestamp_pb2

from csi_qsd.cli import present
from csi_qsd.csi_pb import csi_pb2 as pb

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
VID, SID = "vol-" + "a" * 24, "snap-" + "b" * 24


@pytest.mark.parametrize("size, text", [
    (0, "0 B"),
    (1023, "1023 B"),
    (KIB, "1.0 KiB"),
    (1536, "1.5 KiB"),
    (96 * MIB, "96.0 MiB"),
    (GIB, "1.0 GiB"),
    (GIB - 1, "1.0 GiB"),            # 1023.99... MiB rounds to the next unit, never "1024.0 MiB"
    (GIB - 60 * KIB, "1023.9 MiB"),
    (3 * GIB + 512 * MIB, "3.5 GiB"),
    (2 * TIB, "2.0 TiB"),
    (5 * (1 << 60), "5.0 EiB"),
    (5000 * (1 << 60), "5000.0 EiB"),  # past the last unit: stays in it
])
def test_human_size(size: int, text: str) -> None:
    assert present.human_size(size) == text


def test_table_pads_columns_and_right_aligns_sizes() -> None:
    text = present.table(("ID", "SIZE", "NOTE"), [["a", "1.0 GiB", "x"], ["bbbb", "96.0 MiB", "yy"]])
    assert text.splitlines() == [
        "ID         SIZE   NOTE",
        "a       1.0 GiB   x",
        "bbbb   96.0 MiB   yy",
    ]


def test_table_keeps_each_row_on_one_line_and_marks_empty_cells() -> None:
    text = present.table(("ID", "CONDITION"), [["a", "abnormal: export\ngone,\t restaging"], ["b", ""]])
    assert text.splitlines() == [
        "ID   CONDITION",
        "a    abnormal: export gone, restaging",
        "b    -",
    ]


def test_table_with_no_rows_is_its_header() -> None:
    assert present.table(("ID", "SIZE"), []) == "ID   SIZE"


def test_table_refuses_a_row_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        present.table(("A", "B", "C"), [["1", "2"]])


def volume(vid: str = VID, size: int = 96 * MIB, source: pb.VolumeContentSource | None = None) -> pb.Volume:
    return pb.Volume(volume_id=vid, capacity_bytes=size, content_source=source,
                     volume_context={"export": "filesystem", "format": "qcow2"})


def test_volumes_table() -> None:
    restored = volume("vol-" + "c" * 24, GIB, pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=SID)))
    entries = [
        pb.ListVolumesResponse.Entry(volume=volume(), status=pb.ListVolumesResponse.VolumeStatus(
            published_node_ids=["node-a"], volume_condition=pb.VolumeCondition())),
        pb.ListVolumesResponse.Entry(volume=restored, status=pb.ListVolumesResponse.VolumeStatus(
            volume_condition=pb.VolumeCondition(abnormal=True, message="export lost"))),
    ]
    lines = present.volumes_table(entries).splitlines()
    assert [name.strip() for name in lines[0].split("   ") if name] == [
        "VOLUME ID", "SIZE", "EXPORT", "FORMAT", "SOURCE", "PUBLISHED ON", "CONDITION"]
    assert lines[0].index("SIZE") + len("SIZE") == lines[1].index("MiB") + len("MiB") == lines[2].index("GiB") + 3
    assert lines[1].split() == [VID, "96.0", "MiB", "filesystem", "qcow2", "-", "node-a", "ok"]
    assert lines[2].split() == ["vol-" + "c" * 24, "1.0", "GiB", "filesystem", "qcow2", SID, "-", "abnormal:",
                                "export", "lost"]


def test_a_created_volume_is_a_one_row_table() -> None:
    assert present.volume_table(volume()).splitlines()[1].split() == [VID, "96.0", "MiB", "filesystem", "qcow2", "-"]


def test_snapshots_table() -> None:
    created = timestamp_pb2.Timestamp(seconds=1_700_000_000, nanos=5)
    snapshots = [pb.Snapshot(snapshot_id=SID, source_volume_id=VID, size_bytes=GIB, creation_time=created,
                             ready_to_use=True, group_snapshot_id="group-" + "d" * 24),
                 pb.Snapshot(snapshot_id=SID, source_volume_id=VID, size_bytes=KIB)]
    lines = present.snapshots_table(snapshots).splitlines()
    assert lines[0].split() == ["SNAPSHOT", "ID", "SOURCE", "VOLUME", "SIZE", "CREATED", "READY", "GROUP"]
    assert lines[1].split() == [SID, VID, "1.0", "GiB", "2023-11-14", "22:13:20Z", "yes", "group-" + "d" * 24]
    assert lines[2].split() == [SID, VID, "1.0", "KiB", "-", "no", "-"]


def test_info_table() -> None:
    info = present.PluginInfo(name="csi-qsd.io", version="0.1.0", ready=False, available_bytes=80 * GIB)
    assert present.info_table(info).splitlines() == [
        "DRIVER       VERSION   READY   AVAILABLE",
        "csi-qsd.io   0.1.0     no       80.0 GiB",
    ]


def test_stats_table_gives_bytes_in_units_and_inodes_as_counts() -> None:
    stats = pb.NodeGetVolumeStatsResponse(
        usage=[pb.VolumeUsage(unit=pb.VolumeUsage.Unit.BYTES, total=GIB, used=14 * KIB, available=GIB - 14 * KIB),
               pb.VolumeUsage(unit=pb.VolumeUsage.Unit.INODES, total=65536, used=11, available=65525)],
        volume_condition=pb.VolumeCondition(abnormal=True, message="QSD restarting"))
    assert [line.split() for line in present.stats_table(stats).splitlines()] == [
        ["UNIT", "TOTAL", "USED", "AVAILABLE"],
        ["BYTES", "1.0", "GiB", "14.0", "KiB", "1.0", "GiB"],
        ["INODES", "65536", "11", "65525"],
        ["condition:", "abnormal:", "QSD", "restarting"],
    ]


def test_capacity_table() -> None:
    assert present.capacity_table(VID, 128 * MIB).splitlines()[1].split() == [VID, "128.0", "MiB"]


def test_json_lines_are_what_scripts_read_today() -> None:
    """Protobuf field names, int64 as strings, unset fields left out: the output `-o json` keeps."""
    record = json.loads(present.json_line(volume()))
    assert record == {"volume_id": VID, "capacity_bytes": str(96 * MIB),
                      "volume_context": {"export": "filesystem", "format": "qcow2"}}
    info = {"name": "csi-qsd.io", "version": "0.1.0", "ready": True, "available_bytes": 5}
    assert present.json_line(info) == json.dumps(info)
    assert "\n" not in present.json_line(pb.ListVolumesResponse(entries=[pb.ListVolumesResponse.Entry()] * 3))
