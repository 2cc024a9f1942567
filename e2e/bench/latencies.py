"""Latency series: percentiles, a p50/p99/max summary, and timing a block into a series.

The helpers measure and never judge: a bench prints the figures beside its baseline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between ranks like numpy's default.

    Raises ValueError for no samples or q outside 0..100.
    """
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)



@dataclasses.dataclass(frozen=True)
class Summary:
    """p50, p99 and max of one series of latencies, in milliseconds."""

    count: int
    p50: float
    p99: float
    max: float
    slowest: int  # index of the slowest sample, to find it in logs

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Summary":
        worst = max(range(len(samples)), key=samples.__getitem__)
        return cls(len(samples), percentile(samples, 50), percentile(samples, 99), samples[worst], worst)



@contextlib.contextmanager
def timed(samples: list[float]) -> Iterator[None]:
    """Append the block's wall time in milliseconds to `samples`, if the block succeeds."""
    start = time.perf_counter()
    yield
    samples.append((time.perf_counter() - start) * 1000)



def measured(value: float | None, what: str) -> float:
    """`value`, for a check; raises RuntimeError if it was never measured (the check then prints FAIL)."""
    if value is None:
        raise RuntimeError(f"{what} was not measured")
    return value
