"""Host commands a bench runs for its baselines: `sh` blocking, `output` as the driver runs its tools.
"""

from __future__ import annotations

import subprocess

from csi_qsd.sys.run import run


def sh(*argv: str) -> str:
    """Run a host command for a baseline; raise with its stderr if it fails."""
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout



async def output(*argv: str, timeout: float = 1800) -> str:
    """A host command's stdout, run as the driver runs its tools (`csi_qsd.sys.run`: C locale, HostCommandError)."""
    return (await run(*argv, timeout=timeout))[1]
