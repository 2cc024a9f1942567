"""Crashes at named points, as exceptions the test catches instead of a SIGKILL."""

from __future__ import annotations

from csi_qsd.sys.failpoints import Failpoints


class Crash(BaseException):
    """The process dying at a named point: nothing after it runs, not even an `except Exception` handler."""


class CrashAt(Failpoints):
    """Failpoints that raise `Crash` at the armed names instead of killing the test process.

    Unlike a real crash, `except BaseException` and `finally` blocks still
    run on the way out: arm points that no such block encloses.
    """

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = frozenset(names)

    def hit(self, name: str) -> None:
        if name in self.names:
            raise Crash(name)
