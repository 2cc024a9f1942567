"""Parsing the kernel's block stat lines, believing a loop device's counters only while they are ours, and
asking each volume's pool what the volume occupies."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from csi_qsd.catalog import VolumeRecord, VolumeState
from csi_qsd.metrics import DiskStat, allocated_bytes, parse_disk_stat, read_loop_stat
from csi_qsd.params import VolumeParameters
from csi_qsd.pools.files import FilePool

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


class UnreadablePool(FilePool):
    async def allocated(self, images: list[Path]) -> dict[Path, int]:
        raise OSError(errno.EIO, "Input/output error")


def volume(volume_id: str, image: Path, pool: str) -> VolumeRecord:
    return VolumeRecord(id=volume_id, name=volume_id, capacity=1 << 20, params=VolumeParameters(), image=image,
                        state=VolumeState.READY, created_at=0.0, pool=pool)


async def test_allocated_bytes_asks_the_pool_of_each_volume(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = FilePool(tmp_path)
    written = tmp_path / "vol-a.raw"
    written.write_bytes(b"x" * 8192)
    volumes = [
        volume("vol-a", written, "default"),
        volume("vol-gone", tmp_path / "vol-gone.raw", "default"),  # deleted since the catalog was read
        volume("vol-sick", tmp_path / "vol-a.raw", "sick"),
        volume("vol-elsewhere", Path("extent:fast/vol-elsewhere"), "fast"),  # a pool this driver lacks
    ]
    with caplog.at_level(logging.WARNING, logger="csi_qsd.metrics"):
        found = await allocated_bytes({"default": files, "sick": UnreadablePool(tmp_path, pool_id="sick")}, volumes)
    assert found == {"vol-a": written.stat().st_blocks * 512}
    assert "pool=sick" in caplog.text and "Input/output error" in caplog.text
