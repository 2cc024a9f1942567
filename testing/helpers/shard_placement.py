"""Volumes placed on the shard a test wants, by the driver's own placement rule."""

from __future__ import annotations

from csi_qsd.qsd.shards import place


def namespace_on(shard: int, count: int) -> str:
    """A claim namespace the driver places on `shard` of `count` (its own rule, `csi_qsd.qsd.shards.place`)."""
    return next(f"ns-{n}" for n in range(1000) if place(f"namespace:ns-{n}", count) == shard)
