"""The device-pool allocator against a reference model: a map of allocation units, one flag each.

Random sequences of creates, deletes, in-place growths and moves: extents never
overlap, never leave the data area, are aligned, free space is never lost
(taken + free = the data area), and every answer (fits or not, largest free
gap, how far an extent can grow in place) matches the brute-force model.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from csi_qsd.pools import regions
from csi_qsd.pools.regions import Layout, Region

MIB = 1 << 20
UNITS = 64


class Reference:
    """One flag per alignment unit of the data area."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.owner: list[int | None] = [None] * (layout.data_size // layout.alignment)

    def runs(self) -> list[tuple[int, int]]:
        found, start = [], None
        for i, who in enumerate(self.owner + [0]):
            if who is None and start is None:
                start = i
            elif who is not None and start is not None:
                found.append((start, i - start))
                start = None
        return found

    def fits(self, units: int) -> bool:
        return any(length >= units for _, length in self.runs())

    def longest(self) -> int:
        return max((length for _, length in self.runs()), default=0)

    def take(self, extent: Region, who: int) -> None:
        first = (extent.start - self.layout.data_start) // self.layout.alignment
        for i in range(first, first + extent.length // self.layout.alignment):
            assert self.owner[i] is None, "extent handed out twice"
            self.owner[i] = who

    def room(self, extent: Region) -> int:
        """Units `extent` could span in place: its own, then every free unit after it up to a taken one."""
        first = (extent.start - self.layout.data_start) // self.layout.alignment
        units = extent.length // self.layout.alignment
        while first + units < len(self.owner) and self.owner[first + units] is None:
            units += 1
        return units

    def free(self, who: int) -> None:
        self.owner = [None if o == who else o for o in self.owner]


class Allocator(RuleBasedStateMachine):
    volumes = Bundle("volumes")

    def __init__(self) -> None:
        super().__init__()
        self.layout = Layout(device_size=(UNITS + 1) * MIB + 12345, alignment=MIB)
        self.taken: dict[int, Region] = {}
        self.model = Reference(self.layout)
        self.next_id = 0

    @rule(target=volumes, size=st.integers(1, 24 * MIB))
    def create(self, size: int) -> int:
        units = -(-size // MIB)
        picked = regions.choose(self.layout, self.taken.values(), size)
        assert (picked is not None) == self.model.fits(units)
        self.next_id += 1
        if picked is not None:
            assert picked.length == units * MIB and picked.start % MIB == 0
            self.model.take(picked, self.next_id)
            self.taken[self.next_id] = picked
        return self.next_id

    @rule(volume=volumes)
    def delete(self, volume: int) -> None:
        self.taken.pop(volume, None)
        self.model.free(volume)

    @rule(volume=volumes, size=st.integers(1, 32 * MIB))
    def grow(self, volume: int, size: int) -> None:
        extent = self.taken.get(volume)
        if extent is None:
            return
        limit = regions.grow_limit(self.layout, self.taken.values(), extent)
        assert limit == self.model.room(extent) * MIB, "the in-place limit must match the units free after it"
        fits = regions.grows_in_place(self.layout, self.taken.values(), extent, size)
        assert fits == (regions.align_up(size, MIB) <= limit)
        if fits:
            grown = Region(extent.start, max(extent.length, regions.align_up(size, MIB)))
            self.model.free(volume)
            self.model.take(grown, volume)
            self.taken[volume] = grown

    @rule(volume=volumes, size=st.integers(1, 32 * MIB))
    def move(self, volume: int, size: int) -> None:
        """A move: the new home is chosen while the old one is still held, then the old one is freed."""
        extent = self.taken.get(volume)
        if extent is None:
            return
        wanted = max(size, extent.length)
        target = regions.choose(self.layout, self.taken.values(), wanted)
        assert (target is not None) == self.model.fits(regions.align_up(wanted, MIB) // MIB)
        if target is None:
            return
        assert not target.overlaps(extent)
        self.model.take(target, -volume)
        self.model.free(volume)
        self.model.owner = [volume if who == -volume else who for who in self.model.owner]
        self.taken[volume] = target

    @invariant()
    def disjoint_aligned_inside(self) -> None:
        ordered = sorted(self.taken.values())
        for a, b in zip(ordered, ordered[1:]):
            assert a.end <= b.start
        for e in ordered:
            assert self.layout.data_start <= e.start and e.end <= self.layout.data_end
            assert e.start % MIB == 0 and e.length % MIB == 0

    @invariant()
    def nothing_lost(self) -> None:
        free = regions.free_extents(self.layout, self.taken.values())
        used = sum(e.length for e in self.taken.values())
        assert used + regions.total_free(self.layout, self.taken.values()) == self.layout.data_size
        for a, b in zip(free, free[1:]):
            assert a.end < b.start, "adjacent free extents must be coalesced"
        assert regions.largest_free(self.layout, self.taken.values()) == self.model.longest() * MIB


TestAllocator = Allocator.TestCase
TestAllocator.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 8)), max_size=20))
def test_free_extents_are_the_complement(raw: list[tuple[int, int]]) -> None:
    layout = Layout(64 * MIB + MIB, MIB)
    taken: list[Region] = []
    for unit, length in raw:
        candidate = Region(MIB + unit * MIB, min(length, 64 - unit) * MIB)
        if candidate.length and not any(candidate.overlaps(t) for t in taken):
            taken.append(candidate)
    covered = sorted(taken + regions.free_extents(layout, taken))
    assert covered[0].start == layout.data_start and covered[-1].end == layout.data_end
    for a, b in zip(covered, covered[1:]):
        assert a.end == b.start


def test_alignment_follows_the_optimal_io_size() -> None:
    assert regions.alignment_for(0) == MIB
    assert regions.alignment_for(128 * 1024) == MIB
    assert regions.alignment_for(3 * MIB) == 3 * MIB
    assert regions.alignment_for(511) == MIB
    with pytest.raises(ValueError):
        Layout(10 * MIB, 1000)


def test_best_fit_keeps_large_gaps_whole() -> None:
    layout = Layout(11 * MIB, MIB)
    taken = [Region(2 * MIB, MIB), Region(4 * MIB, MIB)]  # gaps: [1,2) 1 MiB, [3,4) 1 MiB, [5,11) 6 MiB
    assert regions.choose(layout, taken, MIB) == Region(MIB, MIB)
    assert regions.choose(layout, taken, 2 * MIB) == Region(5 * MIB, 2 * MIB)
    assert regions.choose(layout, taken, 7 * MIB) is None


def test_growth_stops_at_the_next_extent_and_the_device_end() -> None:
    layout = Layout(11 * MIB, MIB)  # data area [1, 11) MiB
    a, b = Region(MIB, 2 * MIB), Region(5 * MIB, MIB)
    assert regions.grow_limit(layout, [a, b], a) == 4 * MIB
    assert regions.grows_in_place(layout, [a, b], a, 4 * MIB)
    assert not regions.grows_in_place(layout, [a, b], a, 4 * MIB + 1)
    assert regions.grow_limit(layout, [a, b], b) == 6 * MIB  # up to data_end
    assert regions.grows_in_place(layout, [a, b], b, MIB // 2)  # never shrinks: already long enough
    assert regions.grow_limit(layout, [a, Region(2 * MIB, MIB)], a) == a.length  # a collision never grows
