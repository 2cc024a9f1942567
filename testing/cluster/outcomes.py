"""How each cluster-tier test did in this run, and the check that must run after them all.

The tier's conftest records every report (`record`) and moves the tests
marked `LAST` behind the tier's last test (`move_last`); a test that checks
what the others did asks `outcome` for each of them.
"""

from __future__ import annotations

from collections.abc import MutableSequence
from pathlib import Path
from typing import Protocol, TypeVar

LAST = "cluster_tier_last"
_OUTCOMES: dict[str, list[tuple[str, str]]] = {}


class Collected(Protocol):
    """What `move_last` reads of a collected test item."""

    @property
    def path(self) -> Path: ...

    def get_closest_marker(self, name: str) -> object: ...


def record(nodeid: str, when: str, result: str) -> None:
    """One phase's result ("setup", "call", "teardown") of one test."""
    _OUTCOMES.setdefault(nodeid, []).append((when, result))


def outcome(test: str) -> str:
    """How `test` (a node ID without its parameters) did in this run: "passed" (every parameter's setup, call and
    teardown), or what happened instead."""
    runs = {nodeid: phases for nodeid, phases in _OUTCOMES.items() if nodeid == test or nodeid.startswith(f"{test}[")}
    if not runs:
        return "did not run in this run"
    bad = {nodeid: [f"{when} {result}" for when, result in phases if result != "passed"]
           for nodeid, phases in runs.items()}
    bad = {nodeid: phases for nodeid, phases in bad.items() if phases}
    if bad:
        return "; ".join(f"{nodeid}: {', '.join(phases)}" for nodeid, phases in bad.items())
    return "passed" if all(any(when == "call" for when, _ in phases) for phases in runs.values()) else "never called"


T = TypeVar("T", bound=Collected)


def move_last(items: MutableSequence[T], tier: Path) -> None:
    """Tests marked `LAST` move behind the last test under `tier` (still inside the package: same cluster)."""
    last = [item for item in items if item.get_closest_marker(LAST)]
    for item in last:
        items.remove(item)
    in_tier = [i for i, item in enumerate(items) if tier in Path(item.path).parents]
    at = in_tier[-1] + 1 if in_tier else len(items)
    items[at:at] = last
