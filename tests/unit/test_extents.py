"""Extent arithmetic for changed-block tracking: parsing qemu-img maps, union, clipping, paging."""

from __future__ import annotations

import json

import pytest

from csi_qsd.qcow2 import extents

KIB = 1024


def _map(*entries: tuple[int, int, bool, bool]) -> str:
    return json.dumps([
        {"start": s, "length": n, "depth": 0, "present": p, "zero": z, "data": p and not z} for s, n, p, z in entries
    ])


def test_parse_map_keeps_present_data_and_zero_clusters() -> None:
    text = _map((0, 64 * KIB, True, True), (64 * KIB, 64 * KIB, True, False), (128 * KIB, 1 << 20, False, True),
                (2 << 20, 64 * KIB, True, False))
    assert extents.parse_map(text) == [(0, 128 * KIB), (2 << 20, 64 * KIB)]


def test_parse_map_refuses_a_map_without_present() -> None:
    with pytest.raises(ValueError, match="present"):
        extents.parse_map(json.dumps([{"start": 0, "length": 1, "data": True, "zero": False}]))


def test_union_joins_overlapping_and_touching_ranges() -> None:
    assert extents.union([(0, 10), (30, 10)], [(5, 10), (40, 5)], []) == [(0, 15), (30, 15)]
    assert extents.union() == []


def test_coalesce_drops_empty_ranges_and_keeps_a_contained_one_inside() -> None:
    assert extents.coalesce([(10, 0), (0, 100), (20, 5)]) == [(0, 100)]


def test_clip_cuts_the_range_that_straddles_the_start_and_the_end() -> None:
    ranges = [(0, 100), (200, 100), (400, 100)]
    assert extents.clip(ranges, 250, 450) == [(250, 50), (400, 50)]
    assert extents.clip(ranges, 0, 1000) == ranges
    assert extents.clip(ranges, 500, 1000) == []


def test_pages_bound_each_message_and_always_yield_one() -> None:
    ranges = [(i * 10, 5) for i in range(7)]
    assert [len(p) for p in extents.pages(ranges, 3)] == [3, 3, 1]
    assert list(extents.pages([], 3)) == [[]]
    with pytest.raises(ValueError):
        list(extents.pages(ranges, 0))


def test_blocks_counts_every_block_a_range_touches() -> None:
    assert extents.blocks([(60 * KIB, 8 * KIB)], 64 * KIB) == {0, 1}
    assert extents.blocks([(64 * KIB, 64 * KIB)], 64 * KIB) == {1}
    assert extents.total([(0, 5), (10, 7)]) == 12
