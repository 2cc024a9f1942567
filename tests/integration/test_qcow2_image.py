"""Images written in-process against the ones `qemu-img create` + `qemu-img bitmap --add` make.

For every granularity's layout, sizes from 1 MiB to 5 TiB (one not a whole
number of clusters), with and without a backing file: `qemu-img check`
finds nothing (no leaks, no corruption), `qemu-img info` reports what the
qemu-img-made twin reports, and data written by qemu-io (the block layer QSD
runs) reads back and leaves the image's bitmap enabled and consistent. The
host's own qemu-img (7.2 on Debian 12, still supported) reads them too.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from csi_qsd.qcow2 import blank
from csi_qsd.sys.tools import bundled
from testing import tiers

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
GRANULARITIES = [4 * KIB, 32 * KIB, 64 * KIB, 1 * MIB, 2 * MIB]
SIZES = [1 * MIB, GIB + 512, 5 * TIB]
HOST_QEMU_IMG = "/usr/bin/qemu-img"


def tool(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
    assert done.returncode == 0, f"{argv}: exit {done.returncode}: {done.stderr or done.stdout}"
    return done.stdout


def made_here(path: Path, size: int, granularity: int, **backing: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        blank.write(fd, blank.image_bytes(size, granularity, "cbt", **backing))
    finally:
        os.close(fd)
    return path


def made_by_qemu_img(path: Path, size: int, granularity: int, *backing_args: str) -> Path:
    layout = blank.Layout.for_granularity(granularity)
    options = f"lazy_refcounts=off,cluster_size={layout.cluster_size},extended_l2={'on' if layout.extended_l2 else 'off'}"
    tool(bundled("qemu-img"), "create", "-q", "-f", "qcow2", "-u", "-o", options, *backing_args, str(path), str(size))
    tool(bundled("qemu-img"), "bitmap", "--add", "--enable", "-g", str(granularity), str(path), "cbt")
    return path


def info(path: Path, qemu_img: str = "") -> dict[str, Any]:
    found: dict[str, Any] = json.loads(tool(qemu_img or bundled("qemu-img"), "info", "-U", "--output=json", str(path)))
    return found


def described(found: dict[str, Any]) -> dict[str, Any]:
    """What an image's info says about its shape (not where it lies or how much of the disk it takes)."""
    data = found["format-specific"]["data"]
    return {
        "virtual-size": found["virtual-size"], "cluster-size": found["cluster-size"],
        "backing": found.get("backing-filename"), "backing-format": found.get("backing-filename-format"),
        **{key: data.get(key) for key in ("compat", "lazy-refcounts", "refcount-bits", "corrupt", "extended-l2",
                                           "bitmaps", "compression-type")},
    }


def check(path: Path, qemu_img: str = "") -> dict[str, Any]:
    report: dict[str, Any] = json.loads(tool(qemu_img or bundled("qemu-img"), "check", "--output=json", str(path)))
    return report


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s}B")
@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: f"g{g // KIB}k")
def test_an_image_made_here_is_what_qemu_img_makes(tmp_path: Path, size: int, granularity: int) -> None:
    ours = made_here(tmp_path / "ours.qcow2", size, granularity)
    theirs = made_by_qemu_img(tmp_path / "theirs.qcow2", size, granularity)
    assert described(info(ours)) == described(info(theirs))
    report = check(ours)
    assert report.get("leaks", 0) == 0 and report.get("corruptions", 0) == 0, report


@pytest.mark.parametrize("backing_format", ["qcow2", "raw"])
def test_an_overlay_reads_its_backing_and_is_what_qemu_img_makes(tmp_path: Path, backing_format: str) -> None:
    base = tmp_path / f"base.{backing_format}"
    tool(bundled("qemu-img"), "create", "-q", "-f", backing_format, str(base), str(64 * MIB))
    tool(bundled("qemu-io"), "-f", backing_format, "-c", "write -P 0x5a 1m 64k", str(base))
    ours = made_here(tmp_path / "ours.qcow2", 128 * MIB, 64 * KIB, backing=base.name, backing_format=backing_format)
    theirs = made_by_qemu_img(tmp_path / "theirs.qcow2", 128 * MIB, 64 * KIB, "-b", base.name, "-F", backing_format)
    assert described(info(ours)) == described(info(theirs))
    assert info(ours)["backing-filename"] == base.name
    tool(bundled("qemu-io"), "-r", "-c", "read -P 0x5a 1m 64k", "-c", "read -P 0 100m 64k", str(ours))


def test_writes_land_and_mark_the_bitmap(tmp_path: Path) -> None:
    image = made_here(tmp_path / "v.qcow2", GIB, 4 * KIB)
    tool(bundled("qemu-io"), "-c", "write -P 0xab 1m 4k", "-c", "write -P 0xcd 700m 1m", str(image))
    tool(bundled("qemu-io"), "-r", "-c", "read -P 0xab 1m 4k", "-c", "read -P 0xcd 700m 1m", "-c", "read -P 0 0 1m",
         str(image))
    report = check(image)
    assert report.get("leaks", 0) == 0 and report.get("corruptions", 0) == 0, report
    # QEMU loaded the bitmap, kept it enabled and stored it back consistent (not left "in-use");
    # what it holds is checked end to end by the changed-block tests (GetMetadataDelta).
    assert info(image)["format-specific"]["data"]["bitmaps"] == [
        {"flags": ["auto"], "name": "cbt", "granularity": 4 * KIB}]


@tiers.needs("integration", "" if Path(HOST_QEMU_IMG).exists() else f"{HOST_QEMU_IMG} (the host's QEMU, qemu-utils)")
def test_the_host_qemu_reads_them(tmp_path: Path) -> None:
    image = made_here(tmp_path / "v.qcow2", GIB + 512, 4 * KIB)
    assert described(info(image, HOST_QEMU_IMG))["bitmaps"] == [{"flags": ["auto"], "name": "cbt", "granularity": 4096}]
    report = check(image, HOST_QEMU_IMG)
    assert report.get("leaks", 0) == 0 and report.get("corruptions", 0) == 0, report


@pytest.mark.parametrize("kwargs, problem", [
    (dict(size=0, granularity=64 * KIB, bitmap="cbt"), "multiple of 512"),
    (dict(size=MIB + 1, granularity=64 * KIB, bitmap="cbt"), "multiple of 512"),
    (dict(size=MIB, granularity=64 * KIB, bitmap=""), "name"),
    (dict(size=MIB, granularity=64 * KIB, bitmap="cbt", backing="b.qcow2"), "format"),
    (dict(size=MIB, granularity=64 * KIB, bitmap="cbt", backing="x" * 70000, backing_format="raw"), "header"),
])
def test_what_qcow2_cannot_hold_is_refused(kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        blank.image_bytes(**kwargs)


def test_reads_as_zeros_until_something_is_written(tmp_path: Path) -> None:
    """A never-written image needs no filesystem probe; once written, or over a backing, it does."""
    image = made_here(tmp_path / "v.qcow2", 64 * MIB, 64 * KIB)
    overlay = made_here(tmp_path / "o.qcow2", 64 * MIB, 64 * KIB, backing=image.name, backing_format="qcow2")

    def empty(path: Path, backing_allowed: bool = False) -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            return blank.holds_nothing(fd, backing_allowed=backing_allowed)
        finally:
            os.close(fd)

    assert empty(image) and not empty(overlay) and empty(overlay, backing_allowed=True)
    tool(bundled("qemu-io"), "-c", "write -P 1 60m 4k", str(image))
    tool(bundled("qemu-io"), "-c", "write -P 2 1m 4k", str(overlay))
    assert not empty(image) and not empty(overlay, backing_allowed=True)
