"""Each test's time limit (pytest-timeout), by tier: a hung test fails and the run goes on, its cleanups run.

Generous: several times the slowest test of each tier on this 2-core machine, so a limit means a hang,
never a slow day. A test that needs more says so with `@pytest.mark.timeout(SECONDS)`; its tier still
decides whether fixtures count. The image, e2e and cluster tiers count the test's own call only
(`func_only`): their shared fixtures build the container image, the guest image and the whole cluster,
which take as long as the caches are cold (a fresh machine's first run); every wait inside those builds
and bring-ups has a bound of its own. The other tiers count setup and teardown too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass(frozen=True)
class Limit:
    seconds: int
    func_only: bool


# Longest prefix first wins.
TIERS: tuple[tuple[str, Limit], ...] = (
    # Two runs of the Kubernetes storage e2e suite, bounded by the test itself at 20 and 10 minutes.
    ("e2e/cluster/test_storage_e2e.py", Limit(2700, True)),
    ("e2e/cluster", Limit(900, True)),  # applies examples, waits for pods (bounds of 120-300 s each), reads back
    ("e2e", Limit(900, True)),  # boots TCG guests, runs benches at tiny sizes (each bounded at 120 s)
    ("tests/image", Limit(900, True)),  # runs the driver from the built image
    ("tests/integration", Limit(600, False)),  # real QSD, FUSE, loop devices, fio
    ("tests", Limit(120, False)),  # unit and deploy: pure logic (the slowest unit test: 2.4 s)
)
DEFAULT = Limit(600, False)


def limit_for(path: str, explicit: int | None = None) -> Limit:
    """The limit of a test in `path` (relative to the project root): its tier's, or `explicit` seconds."""
    parts = PurePosixPath(path).parts
    for prefix, limit in TIERS:
        if parts[: len(PurePosixPath(prefix).parts)] == PurePosixPath(prefix).parts:
            return Limit(explicit, limit.func_only) if explicit is not None else limit
    return Limit(explicit, DEFAULT.func_only) if explicit is not None else DEFAULT
