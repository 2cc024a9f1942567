"""Targets whose consumers a QSD crash cut off: the rebuild replaced the data path beneath them.

A container takes a private copy of its target's mount when it starts. After
QSD dies, the rebuild mounts a new filesystem (or attaches a new loop device)
and binds it at every target again, but a container that started before
still holds the dead one and gets EIO on every access until it restarts.
This records, per target path, that this happened and why, so that
NodeGetVolumeStats reports the volume abnormal at that target (kubelet turns
it into an event on the pod), and tells the listeners (the pod healer in a
cluster) once per rebuild. The record of a target ends when the target is
unpublished (its pod is gone). Kept in memory: a restarted driver forgets it,
and the condition it reported is gone with it. No I/O here.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# In every condition message of a target cut off by a rebuild: how tools and tests tell it from a QSD away.
REBUILT = "rebuilt its data path"


@dataclasses.dataclass(frozen=True)
class CutOff:
    """One volume's data path rebuilt under the pods of `targets` after the QSD serving it died."""

    volume_id: str
    block: bool
    targets: tuple[Path, ...]
    at: datetime.datetime  # when the rebuild brought the volume back (UTC)

    def message(self) -> str:
        """What the volume's condition says at each of `targets`."""
        what = "raw block device" if self.block else "filesystem"
        again = "a new FUSE export and loop device" if self.block else \
            "a new FUSE export and loop device, the filesystem mounted again"
        return (f"qemu-storage-daemon serving volume {self.volume_id} died and the driver {REBUILT} at "
                f"{self.at:%Y-%m-%dT%H:%M:%SZ} ({again}); a container started before still holds the dead "
                f"{what} and gets I/O errors (EIO) until it restarts")


class CutOffTargets:
    """The targets cut off by rebuilds, and who hears of each rebuild."""

    def __init__(self) -> None:
        self._by_target: dict[Path, CutOff] = {}
        self._listeners: list[Callable[[CutOff], None]] = []

    def listen(self, listener: Callable[[CutOff], None]) -> None:
        """Call `listener` (which must not block) with each rebuild recorded from now on."""
        self._listeners.append(listener)

    def add(self, cut: CutOff) -> None:
        """Record a rebuild under published targets and tell the listeners; a listener's error is logged."""
        for target in cut.targets:
            self._by_target[target] = cut
        log.warning("event=consumers_cut_off volume_id=%s targets=%s", cut.volume_id,
                    ",".join(str(t) for t in cut.targets))
        for listener in self._listeners:
            try:
                listener(cut)
            except Exception:
                log.exception("event=cut_off_listener_failed volume_id=%s", cut.volume_id)

    def at(self, target: Path) -> CutOff | None:
        """The rebuild that cut off the consumer of `target`, or None while its consumer is well."""
        return self._by_target.get(target)

    def released(self, target: Path) -> None:
        """The target is unpublished: its consumer, and what cut it off, are gone."""
        self._by_target.pop(target, None)
