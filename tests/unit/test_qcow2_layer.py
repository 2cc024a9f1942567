"""L2 entries to ranges: every subcluster bitmap pattern, compressed and zero clusters, without an image."""

from __future__ import annotations

import struct

import pytest

from csi_qsd.qcow2 import tables as L

CLUSTER = 128 << 10
SUB = CLUSTER // 32
HOST = 5 * CLUSTER  # some host offset


def extended(*entries: tuple[int, int]) -> bytes:
    return b"".join(struct.pack(">QQ", entry, bitmap) for entry, bitmap in entries)


def scan_extended(*entries: tuple[int, int]) -> list[tuple[int, int]]:
    found: list[tuple[int, int]] = []
    L._scan_extended(extended(*entries), 0, CLUSTER, found)
    return found


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
def test_subcluster_bitmaps(bitmap: int, ranges: list[tuple[int, int]]) -> None:
    assert scan_extended((HOST, bitmap)) == ranges


def test_clusters_are_placed_by_their_index_and_a_compressed_one_is_whole() -> None:
    found = scan_extended((0, 0), (HOST, 1 << 4), (L.COMPRESSED | HOST, 0))
    assert found == [(CLUSTER + 4 * SUB, SUB), (2 * CLUSTER, CLUSTER)]


def test_standard_entries() -> None:
    table = struct.pack(">5Q", 0, HOST, L.ZERO, L.COMPRESSED | HOST, 1 << 63)
    found: list[tuple[int, int]] = []
    L._scan_standard(table, 10 * CLUSTER, CLUSTER, found)
    # data, zero, compressed: there; empty, or only the "copied" flag with no offset: not there
    assert found == [(11 * CLUSTER, CLUSTER), (12 * CLUSTER, CLUSTER), (13 * CLUSTER, CLUSTER)]
