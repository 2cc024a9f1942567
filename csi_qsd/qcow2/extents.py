"""Byte extents of a volume: parse qcow2 allocation maps, merge, clip and page them.

Changed-block tracking answers with lists of (offset, length) ranges, sorted
and non-overlapping. They come from `qemu-img map --output=json`, are merged
across the images of a chain, clipped to the snapshot's capacity and to the
caller's `starting_offset`, and cut into messages of at most `max_results`.
Pure functions only: no I/O, no catalog, no gRPC, so every rule is unit-tested.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Iterator
from typing import TypedDict

Extent = tuple[int, int]  # (byte offset, length), length > 0


class MapEntry(TypedDict, total=False):
    """One record of `qemu-img map --output=json` (QEMU >= 6.0 adds `present`)."""

    start: int
    length: int
    depth: int
    present: bool
    zero: bool
    data: bool


def parse_map(text: str) -> list[Extent]:
    """The ranges `qemu-img map --output=json` reports as present in the image (or its chain).

    `present` is true for every cluster some layer holds, a zero cluster
    included: a discard in an overlay writes a zero cluster, which changed the
    data as much as a write did. Older qemu-img without `present` is refused
    rather than guessed at (`data` alone would miss zero clusters).
    """
    entries: list[MapEntry] = json.loads(text)
    found: list[Extent] = []
    for entry in entries:
        if "present" not in entry:
            raise ValueError("qemu-img map did not report 'present' (QEMU >= 6.0 needed)")
        if entry["present"] and entry["length"] > 0:
            found.append((entry["start"], entry["length"]))
    return coalesce(found)


def coalesce(extents: Iterable[Extent]) -> list[Extent]:
    """Sorted extents, overlapping or touching ranges joined."""
    out: list[Extent] = []
    for offset, length in sorted(extents):
        if length <= 0:
            continue
        if out and offset <= out[-1][0] + out[-1][1]:
            last_offset, last_length = out[-1]
            out[-1] = (last_offset, max(last_length, offset + length - last_offset))
        else:
            out.append((offset, length))
    return out


def union(*lists: list[Extent]) -> list[Extent]:
    """The ranges covered by any of several sorted extent lists."""
    return coalesce(heapq.merge(*lists))


def clip(extents: list[Extent], start: int, end: int) -> list[Extent]:
    """The parts of `extents` inside [start, end): a first range that straddles `start` begins at it."""
    out: list[Extent] = []
    for offset, length in extents:
        lo, hi = max(offset, start), min(offset + length, end)
        if hi > lo:
            out.append((lo, hi - lo))
    return out


def pages(extents: list[Extent], max_results: int) -> Iterator[list[Extent]]:
    """Cut `extents` into lists of at most `max_results`; at least one (maybe empty) list."""
    if max_results <= 0:
        raise ValueError("max_results must be positive")
    if not extents:
        yield []
        return
    for i in range(0, len(extents), max_results):
        yield extents[i:i + max_results]


def total(extents: Iterable[Extent]) -> int:
    return sum(length for _, length in extents)


def blocks(extents: Iterable[Extent], block: int) -> set[int]:
    """Indexes of the `block`-sized blocks the extents touch (for comparing with a truth)."""
    out: set[int] = set()
    for offset, length in extents:
        out.update(range(offset // block, (offset + length - 1) // block + 1))
    return out
