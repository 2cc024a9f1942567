"""Run host tools as asyncio subprocesses and turn failures into typed errors."""

from __future__ import annotations

import asyncio
import logging

from csi_qsd.errors import HostCommandError

log = logging.getLogger(__name__)


async def run(*argv: str, timeout: float = 120.0, check: bool = True) -> tuple[int, str]:
    """Run `argv`, return (exit code, stdout); raise HostCommandError with stderr on failure."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError as exc:
        proc.kill()
        await proc.wait()
        raise HostCommandError(f"{argv[0]} did not finish within {timeout}s: {' '.join(argv)}") from exc
    except asyncio.CancelledError:
        # The caller gave up (shutdown, a cancelled background job): leave no orphan behind.
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    code = proc.returncode if proc.returncode is not None else -1
    if check and code != 0:
        message = err.decode(errors="replace").strip() or out.decode(errors="replace").strip()
        raise HostCommandError(f"{' '.join(argv)} failed (exit {code}): {message}")
    log.debug("event=run argv=%r code=%d", " ".join(argv), code)
    return code, out.decode(errors="replace")
