"""Parsing the kernel's block stat lines, and believing a loop device's counters only while it is ours."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi_qsd.metrics import DiskStat, parse_disk_stat, read_loop_stat

# A loop device's stat line from a 6.x kernel (17 fields).
LINE_17 = ("     296        1     7410       37      150      236   125452      238        0      208      428"
           "        2        0  2097160        0       48      152\n")


def test_parse_17_fields() -> None:
    assert parse_disk_stat(LINE_17) == DiskStat(
        read_ios=296, read_sectors=7410, read_ms=37, write_ios=150, write_sectors=125452, write_ms=238,
        in_flight=0, io_ms=208, discard_ios=2, discard_sectors=2097160, discard_ms=0, flush_ios=48, flush_ms=152,
    )


def test_parse_old_kernels_without_discard_and_flush() -> None:
    stat = parse_disk_stat("1 0 8 2 3 0 24 4 0 5 6")
    assert (stat.read_ios, stat.write_sectors, stat.io_ms, stat.discard_ios, stat.flush_ios) == (1, 24, 5, 0, 0)


@pytest.mark.parametrize("text", ["", "1 2 3", "a b c d e f g h i j k"])
def test_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_disk_stat(text)


def fake_loop(sys_block: Path, name: str, backing: str, stat: str = LINE_17) -> None:
    (sys_block / name / "loop").mkdir(parents=True)
    (sys_block / name / "loop" / "backing_file").write_text(backing + "\n")
    (sys_block / name / "stat").write_text(stat)


def test_read_loop_stat_checks_the_backing_file(tmp_path: Path) -> None:
    export = Path("/var/lib/csi-qsd/exports/vol-1/disk")
    fake_loop(tmp_path, "loop3", str(export))
    fake_loop(tmp_path, "loop4", "/somewhere/else.img")  # the number was reused by someone else
    fake_loop(tmp_path, "loop5", f"{export} (deleted)")
    assert read_loop_stat(Path("/dev/loop3"), export, tmp_path) == parse_disk_stat(LINE_17)
    assert read_loop_stat(Path("/dev/loop4"), export, tmp_path) is None
    assert read_loop_stat(Path("/dev/loop5"), export, tmp_path) is not None
    assert read_loop_stat(Path("/dev/loop9"), export, tmp_path) is None  # detached: gone from sysfs
    assert read_loop_stat(Path("/dev/sda"), export, tmp_path) is None


def test_read_loop_stat_survives_a_torn_stat_file(tmp_path: Path) -> None:
    export = Path("/x/disk")
    fake_loop(tmp_path, "loop1", str(export), stat="")
    assert read_loop_stat(Path("/dev/loop1"), export, tmp_path) is None
