"""Layer bitmaps: what each image of a chain changed, kept in qcow2 persistent dirty bitmaps across merges.

Every image the file pool makes carries an enabled persistent bitmap
`cbt`: QSD marks in it every write and discard while the image is a
volume's top, so once the image is frozen by a snapshot it says what that
snapshot's layer changed. Deltas between snapshots whose images are all
still layers of one chain come from the qcow2 allocation maps; the bitmaps
matter where a flatten merges the layers below snapshot image M into M.
Before the merge, M's own `cbt` is disabled (the merge's writes are not
changes) and each merged layer's record is copied into M as a disabled
persistent bitmap named `cbt-NNN-IMAGE`: NNN counts layers down from M (000
is the one right below it), IMAGE is the layer's file name. A layer merged
before carries its own records along, renumbered below it.

A bitmap QSD could not close cleanly (a SIGKILL while the image was a
writable top) is inconsistent: QEMU keeps its in-use flag and never uses it
again. Its layer's record is then carried as an empty `cbtlost-NNN-IMAGE`,
and any delta that needs it answers with a superset and says so. No I/O here.
"""

from __future__ import annotations

import dataclasses
import re

OWN = "cbt"
EMPTY_GRANULARITY = 65536  # of an empty `cbtlost-` record: it is never read
_CARRIED = re.compile(r"^cbt(lost)?-(\d{3,})-(.+)$")


@dataclasses.dataclass(frozen=True)
class Bitmap:
    """A persistent bitmap of one image, as QSD or `qemu-img info` describes it."""

    name: str
    granularity: int
    consistent: bool  # False: QEMU found it in use after a crash (or lost it); it must not be read


@dataclasses.dataclass(frozen=True)
class Carried:
    """A merged layer's record inside the image it was merged into."""

    depth: int  # 0: the layer right below the image
    image: str  # the merged layer's file name
    lost: bool  # its record was inconsistent when it was merged: only a superset is known

    @property
    def name(self) -> str:
        return carried_name(self.depth, self.image, self.lost)


def carried_name(depth: int, image: str, lost: bool) -> str:
    return f"cbt{'lost' if lost else ''}-{depth:03d}-{image}"


def parse_carried(name: str) -> Carried | None:
    match = _CARRIED.match(name)
    if match is None:
        return None
    return Carried(int(match.group(2)), match.group(3), match.group(1) is not None)


@dataclasses.dataclass(frozen=True)
class CarryStep:
    """One bitmap to create in the merge target: `target` from `source` of layer `layer`, or empty if lost."""

    target: str
    granularity: int
    layer: int  # index into the layers below the target, 0 = right below
    source: str | None  # None: lost, created empty to say so


def plan_carry(layers: list[tuple[str, dict[str, Bitmap]]], present: set[str]) -> list[CarryStep]:
    """The bitmaps to create in a merge target, given the layers below it (newest first: file name, bitmaps).

    Names the target already holds (a merge retried after a crash) are
    skipped: layers are frozen, so their records are the same.
    """
    steps: list[CarryStep] = []
    depth = 0
    for index, (image, bitmaps) in enumerate(layers):
        own = bitmaps.get(OWN)
        lost = own is None or not own.consistent
        granularity = own.granularity if own is not None else EMPTY_GRANULARITY
        steps.append(CarryStep(carried_name(depth, image, lost), granularity, index, None if lost else OWN))
        below = sorted(((c, b) for c, b in ((parse_carried(n), b) for n, b in bitmaps.items()) if c is not None),
                       key=lambda pair: pair[0].depth)
        for carried, bitmap in below:
            lost_below = carried.lost or not bitmap.consistent
            steps.append(CarryStep(carried_name(depth + 1 + carried.depth, carried.image, lost_below),
                                   bitmap.granularity, index, None if lost_below else bitmap.name))
        depth += 1 + (max((c.depth for c, _ in below), default=-1) + 1)
    return [step for step in steps if step.target not in present]


@dataclasses.dataclass(frozen=True)
class Needed:
    """The records a delta reads from a merged bottom image: exact, or why only a superset is known."""

    names: list[str]
    lost: str = ""  # non-empty: the reason the answer must fall back


def needed_for(base_image: str, bitmaps: dict[str, Bitmap]) -> Needed | None:
    """Which bitmaps of a merged image hold what changed after `base_image` was cut; None if it was not merged in.

    The image's own record and every carried layer above the base's are needed.
    """
    carried = {c.depth: c for c in map(parse_carried, bitmaps) if c is not None}
    base = next((c for c in carried.values() if c.image == base_image), None)
    if base is None:
        return None
    own = bitmaps.get(OWN)
    if own is None or not own.consistent:
        return Needed([], f"the merged image's own record ({OWN}) is inconsistent or missing")
    names = [OWN]
    for depth in range(base.depth):
        layer = carried.get(depth)
        if layer is None:
            return Needed([], f"no record of the layer {depth} below the merged image")
        if layer.lost or not bitmaps[layer.name].consistent:
            return Needed([], f"the record of layer {layer.image} was lost (QSD stopped without closing it)")
        names.append(layer.name)
    return Needed(names)
