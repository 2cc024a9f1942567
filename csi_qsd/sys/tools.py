"""Where the QEMU tools come from.

`scripts/install.sh` puts wrappers for QEMU >= 10.0.8 (Debian 13's, with
their own libraries) into the virtualenv's `bin` directory on Debian 12
hosts, whose own QEMU 7.2 corrupts parallel writes over FUSE. Those wrappers
win over the host's tools; without them (a Debian 13 image) the tools on
PATH are used. Flags override both.
"""

from __future__ import annotations

import sys
from pathlib import Path


def bundled(name: str) -> str:
    """The venv's wrapper for QEMU tool `name` if there is one, else `name` (looked up on PATH)."""
    candidate = Path(sys.prefix) / "bin" / name
    return str(candidate) if candidate.is_file() else name
