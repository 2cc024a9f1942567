"""L2 entries to ranges: every subcluster bitmap pattern, compressed and zero clusters, in a hand-made image.

Each image is a qcow2 v3 header, one L1 entry and one L2 table, read by the
public `read_layer` (which also merges touching ranges and clips them to the
virtual size).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from csi_qsd.qcow2 import header
from csi_qsd.qcow2 import tables as L

CLUSTER_BITS = 17
CLUSTER = 1 << CLUSTER_BITS
SUB = CLUSTER // 32
HOST = 5 * CLUSTER  # some host offset
SIZE = 64 * CLUSTER


def image_with(path: Path, table: bytes, *, extended: bool, crypt: int = 0) -> Path:
    """An image of SIZE bytes whose L1 table (at cluster 1) points at one L2 table (at cluster 2): `table`."""
    head = header.Header(3, 0, 0, CLUSTER_BITS, SIZE, crypt, 1, CLUSTER, 0, 0, 0, 0,
                         incompatible=header.INCOMPAT_EXTENDED_L2 if extended else 0, length=header.STRUCT.size)
    with path.open("wb") as out:
        out.write(head.pack())
        out.seek(CLUSTER)
        out.write(struct.pack(">Q", 2 * CLUSTER))
        out.seek(2 * CLUSTER)
        out.write(table.ljust(CLUSTER, b"\0"))
    return path


def scan_extended(tmp_path: Path, *entries: tuple[int, int]) -> list[tuple[int, int]] | None:
    table = b"".join(struct.pack(">QQ", entry, bitmap) for entry, bitmap in entries)
    return L.read_layer(image_with(tmp_path / "layer.qcow2", table, extended=True))


@pytest.mark.parametrize("bitmap, ranges", [
    (0, []),
    (1, [(0, SUB)]),
    (1 << 31, [(31 * SUB, SUB)]),
    (0xFFFFFFFF, [(0, CLUSTER)]),
    (0b1011, [(0, 2 * SUB), (3 * SUB, SUB)]),
    (0x55555555, [(2 * i * SUB, SUB) for i in range(16)]),
    (0b0110 << 32, [(SUB, 2 * SUB)]),  # subclusters that read as zeros are there too
    ((0b01 << 32) | 0b10, [(0, 2 * SUB)]),  # a zero one beside an allocated one: one run
    ((0xFFFF << 48) | 0xFFFF, [(0, CLUSTER)]),  # zero upper half, allocated lower half
])
def test_subcluster_bitmaps(tmp_path: Path, bitmap: int, ranges: list[tuple[int, int]]) -> None:
    assert scan_extended(tmp_path, (HOST, bitmap)) == ranges


def test_clusters_are_placed_by_their_index_and_a_compressed_one_is_whole(tmp_path: Path) -> None:
    found = scan_extended(tmp_path, (0, 0), (HOST, 1 << 4), (L.COMPRESSED | HOST, 0))
    assert found == [(CLUSTER + 4 * SUB, SUB), (2 * CLUSTER, CLUSTER)]


def test_standard_entries(tmp_path: Path) -> None:
    table = struct.pack(">17Q", *[0] * 10, 0, HOST, 0, L.ZERO, 0, L.COMPRESSED | HOST, 1 << 63)
    found = L.read_layer(image_with(tmp_path / "layer.qcow2", table, extended=False))
    # data, zero, compressed: there; empty, or only the "copied" flag with no offset: not there
    assert found == [(11 * CLUSTER, CLUSTER), (13 * CLUSTER, CLUSTER), (15 * CLUSTER, CLUSTER)]


def test_a_luks_image_s_tables_are_read_as_a_plain_one_s_and_the_old_aes_is_left_to_qemu(tmp_path: Path) -> None:
    """A LUKS image's data clusters are ciphertext, its tables are not: they map the volume's offsets alike."""
    table = struct.pack(">3Q", 0, HOST, L.ZERO)
    luks = L.read_layer(image_with(tmp_path / "luks.qcow2", table, extended=False, crypt=header.CRYPT_LUKS))
    assert luks == [(CLUSTER, 2 * CLUSTER)]
    assert L.read_layer(image_with(tmp_path / "aes.qcow2", table, extended=False, crypt=1)) is None
