"""The qcow2 header as `csi_qsd.qcow2.header` parses it: what `blank` writes reads back, version 2 included."""

from __future__ import annotations

from pathlib import Path

from csi_qsd.qcow2 import blank, header, layer_bitmaps


def test_a_blank_images_header_reads_back(tmp_path: Path) -> None:
    image = tmp_path / "a.qcow2"
    with open(image, "wb") as f:
        blank.write(f.fileno(), blank.image_bytes(1 << 26, 1 << 12, layer_bitmaps.OWN, backing="b.qcow2",
                                                  backing_format="qcow2"))
    head = header.read_file(image)
    assert head is not None
    assert (head.version, head.size, head.length, head.refcount_order) == (3, 1 << 26, blank.HEADER_LENGTH, 4)
    assert head.incompatible == header.INCOMPAT_EXTENDED_L2  # granularity 4 KiB: subclusters
    assert image.read_bytes()[head.backing_offset:head.backing_offset + head.backing_size] == b"b.qcow2"


def test_a_version_2_header_gets_version_3_defaults() -> None:
    v2 = header.Header(2, 200, 4, 16, 1 << 30, 0, 2, 3 << 16, 1 << 16, 1, 0, 0)
    # What follows a version 2 header on disk (here: bytes that would read as feature bits) is not header.
    head = header.parse(v2.pack()[:header.V2_LENGTH] + b"\xff" * 64)
    assert head == v2 and (head.incompatible, head.refcount_order, head.length) == (0, 4, header.V2_LENGTH)


def test_what_is_not_a_whole_qcow2_header_is_none(tmp_path: Path) -> None:
    whole = header.Header(3, 0, 0, 16, 1 << 30, 0, 1, 3 << 16, 1 << 16, 1, 0, 0, length=header.STRUCT.size).pack()
    assert header.parse(whole) is not None
    assert header.parse(whole[:-1]) is None
    assert header.parse(b"QFI\xfa" + whole[4:]) is None
    (tmp_path / "raw").write_bytes(b"\0" * 4096)
    assert header.read_file(tmp_path / "raw") is None
