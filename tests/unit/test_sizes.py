"""params.choose_size: the CSI capacity_range semantics, at 1 MiB granularity.

The spec: required_bytes is "at least", limit_bytes "at most", 0 means unset
for either, and a range the plugin cannot satisfy is OUT_OF_RANGE.
"""

from __future__ import annotations

import itertools

import pytest

from csi_qsd.errors import OutOfRange
from csi_qsd.params import DEFAULT_SIZE, GIB, MIB, SIZE_GRANULARITY, choose_size


def test_granularity_and_default() -> None:
    assert SIZE_GRANULARITY == MIB
    assert DEFAULT_SIZE == GIB


@pytest.mark.parametrize("required, limit, expected", [
    (0, 0, GIB),                       # nothing asked: the default
    (1, 0, MIB),                       # rounded up to the granularity
    (MIB, 0, MIB),
    (MIB + 1, 0, 2 * MIB),
    (5 * GIB, 0, 5 * GIB),
    (3 * GIB + 7, 0, 3 * GIB + MIB),
    (0, 512 * MIB, 512 * MIB),         # the default would exceed the limit: take the limit
    (0, 2 * GIB, GIB),                 # the default fits under the limit
    (0, MIB + MIB // 2, MIB),          # limit not on the granularity: round down
    (MIB, MIB, MIB),                   # exact
    (1, MIB + 5, MIB),
    (MIB + MIB // 2, 2 * MIB, 2 * MIB),
    (MIB + 1, 3 * MIB - 1, 2 * MIB),
    (GIB, GIB, GIB),
    (0, MIB, MIB),
])
def test_size_for_range(required: int, limit: int, expected: int) -> None:
    assert choose_size(required, limit) == expected


@pytest.mark.parametrize("required, limit, needle", [
    (-1, 0, "negative"),
    (0, -1, "negative"),
    (-MIB, -MIB, "negative"),
    (2 * MIB, MIB, "exceeds limit_bytes"),
    (MIB + 1, MIB, "exceeds limit_bytes"),
    (MIB + MIB // 2, MIB + MIB // 2, "granularity"),  # no multiple of 1 MiB in [1.5, 1.5] MiB
    (0, 1000, "granularity"),                          # limit below the smallest volume
    (1, 1000, "granularity"),
    (MIB + 1, 2 * MIB - 1, "granularity"),
])
def test_impossible_ranges_are_out_of_range(required: int, limit: int, needle: str) -> None:
    with pytest.raises(OutOfRange, match=needle):
        choose_size(required, limit)


def test_out_of_range_message_names_the_numbers() -> None:
    with pytest.raises(OutOfRange) as info:
        choose_size(5 * MIB, 3 * MIB)
    assert str(5 * MIB) in str(info.value) and str(3 * MIB) in str(info.value)


POINTS = [0, 1, MIB - 1, MIB, MIB + 1, 2 * MIB - 1, 2 * MIB, 3 * MIB + 12345, GIB - 1, GIB, GIB + 1, 2 * GIB]


@pytest.mark.parametrize("required, limit", list(itertools.product(POINTS, POINTS)))
def test_any_answer_lies_in_the_range_on_the_granularity(required: int, limit: int) -> None:
    """Either a size in [required, limit] that is a positive multiple of 1 MiB, or OUT_OF_RANGE when none exists."""
    feasible = [s for s in range(MIB, 2 * GIB + 1, MIB) if s >= required and (not limit or s <= limit)]
    try:
        size = choose_size(required, limit)
    except OutOfRange:
        assert not feasible, f"a size existed: {feasible[:3]}"
        return
    assert size % MIB == 0 and size > 0
    assert size >= required and (not limit or size <= limit)
    if required:
        assert size == feasible[0]  # the smallest that satisfies the request, no waste
