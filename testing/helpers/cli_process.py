"""`csi-qsd` run as a child process, as an operator or a container runs it.

`csi_qsd` runs one command to its end and hands back its exit status and
output; `start_qsd_container` starts `csi-qsd qsd-run` in the foreground,
as the qsd container of the external layout does, and leaves it running.
"""

from __future__ import annotations

import asyncio
import sys

from testing.harness import Sandbox


async def csi_qsd(*argv: str) -> tuple[int, str, str]:
    """`csi-qsd ARGV...` in a child process: its exit status, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "csi_qsd.cli", *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def start_qsd_container(box: Sandbox, *extra: str) -> asyncio.subprocess.Process:
    """`csi-qsd qsd-run`, as the qsd container's command: QSD in the foreground."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "csi_qsd.cli", "qsd-run", "--state-dir", str(box.state_dir), *extra,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
    )
