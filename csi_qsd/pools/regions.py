"""The partition allocator of a device pool: pure logic over a list of taken extents.

Free space is never stored: it is whatever lies between the taken extents
of the data area, so it is coalesced by construction and a crash cannot
leave a free list out of step with the taken ones. An extent being scrubbed
is taken (by nobody) until its scrub is recorded, so it is never handed out
with a previous tenant's bytes on it. Everything is aligned to the layout's
alignment (1 MiB, or the device's optimal I/O size when that is larger), so
no volume shares a physical block or an erase unit's write with another.
This module does no I/O and knows nothing of the catalog, QSD or devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

MIB = 1 << 20


@dataclasses.dataclass(frozen=True, order=True)
class Region:
    """`length` bytes of the device from byte `start`."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    def overlaps(self, other: "Region") -> bool:
        return self.start < other.end and other.start < self.end


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where volumes may live on a device: [data_start, data_end), in units of `alignment`.

    The first aligned unit holds the pool's label, so it is never handed out.
    """

    device_size: int
    alignment: int

    def __post_init__(self) -> None:
        if self.alignment <= 0 or self.alignment % 4096:
            raise ValueError(f"alignment {self.alignment} must be a positive multiple of 4096")

    @property
    def data_start(self) -> int:
        return self.alignment

    @property
    def data_end(self) -> int:
        return max(self.data_start, align_down(self.device_size, self.alignment))

    @property
    def data_size(self) -> int:
        return self.data_end - self.data_start


def alignment_for(optimal_io_size: int) -> int:
    """1 MiB, or the least common multiple of 1 MiB and the device's optimal I/O size (0: not reported)."""
    if optimal_io_size <= 0 or optimal_io_size % 512:
        return MIB
    return math.lcm(MIB, optimal_io_size)


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int) -> int:
    return value // alignment * alignment


def free_extents(layout: Layout, taken: Iterable[Region]) -> list[Region]:
    """The gaps between `taken` extents in the data area, in order, each maximal (coalesced)."""
    gaps: list[Region] = []
    cursor = layout.data_start
    for extent in sorted(taken):
        if extent.start > cursor:
            gaps.append(Region(cursor, extent.start - cursor))
        cursor = max(cursor, extent.end)
    if layout.data_end > cursor:
        gaps.append(Region(cursor, layout.data_end - cursor))
    return gaps


def choose(layout: Layout, taken: Iterable[Region], size: int) -> Region | None:
    """An aligned extent of at least `size` bytes in free space, or None if no gap is large enough.

    Best fit (the smallest gap that holds it, the lowest on a tie) keeps the
    large gaps whole for large volumes.
    """
    if size <= 0:
        raise ValueError(f"extent size must be positive, got {size}")
    length = align_up(size, layout.alignment)
    fitting = [gap for gap in free_extents(layout, taken) if gap.length >= length]
    if not fitting:
        return None
    best = min(fitting, key=lambda gap: (gap.length, gap.start))
    return Region(best.start, length)


def total_free(layout: Layout, taken: Iterable[Region]) -> int:
    return sum(gap.length for gap in free_extents(layout, taken))


def largest_free(layout: Layout, taken: Iterable[Region]) -> int:
    """The largest volume that can be created now: the longest free gap."""
    return max((gap.length for gap in free_extents(layout, taken)), default=0)


def grows_in_place(layout: Layout, taken: Iterable[Region], extent: Region, size: int) -> bool:
    """True if `extent` can grow to `size` bytes into the free space right after it."""
    return align_up(size, layout.alignment) <= grow_limit(layout, taken, extent)


def grow_limit(layout: Layout, taken: Iterable[Region], extent: Region) -> int:
    """The longest `extent` can become in place: up to the next taken extent, or the end of the data area."""
    following = [other.start for other in taken if other != extent and other.start >= extent.end]
    overlapping = any(other.overlaps(extent) for other in taken if other != extent)
    if overlapping:
        return extent.length  # never grow what already collides (a corrupt catalog): refuse, do not guess
    return max(extent.length, min(following, default=layout.data_end) - extent.start)
