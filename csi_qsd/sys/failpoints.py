"""Named crash points, to prove that a crash at any step leaves nothing a restart cannot repair.

Off unless `csi-qsd serve` is started with CSI_QSD_FAILPOINTS=name[,name…];
an armed point kills the process with SIGKILL, exactly like an OOM kill or a
node losing power would, with no cleanup of any kind.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


class Failpoints:
    """The set of armed crash points of one driver process."""

    def __init__(self, armed: frozenset[str] = frozenset()) -> None:
        self._armed = armed

    @classmethod
    def parse(cls, text: str) -> "Failpoints":
        return cls(frozenset(name.strip() for name in text.split(",") if name.strip()))

    def hit(self, name: str) -> None:
        if name in self._armed:
            log.warning("event=failpoint name=%s action=SIGKILL", name)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


NONE = Failpoints()
