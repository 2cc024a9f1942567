"""Run host tools as asyncio subprocesses and turn failures into typed errors.

Tools run in the C locale: their output is parsed (dumpe2fs fields, blkid
values) and their messages end up in errors, and both must read the same on
every node whatever the host's language. Callers decide by exit code, never
by a tool's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence

from csi_qsd.errors import HostCommandError

log = logging.getLogger(__name__)


def tool_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment, PATH included) with the locale fixed to C."""
    env = dict(os.environ if base is None else base)
    env.pop("LANGUAGE", None)  # a language list some tools honour even under LC_ALL
    env["LC_ALL"] = "C"
    return env


@contextlib.contextmanager
def secret_pipes(*secrets: bytes) -> Iterator[list[int]]:
    """One pipe per secret, filled and closed for writing: the read ends, for `run`'s `pass_fds` (`/dev/fd/N`).

    A tool that needs several secrets at once (qemu-img amend: the key that
    opens an image and the one it adds) reads each from its own pipe, so
    none is on a command line or in a file. A secret fits a pipe's buffer.
    """
    ends: list[int] = []
    try:
        for secret in secrets:
            read, write = os.pipe()
            ends.append(read)
            try:
                os.write(write, secret)
            finally:
                os.close(write)
        yield ends
    finally:
        for fd in ends:
            os.close(fd)


async def run(*argv: str, timeout: float = 120.0, check: bool = True, stdin: bytes | None = None,
              pass_fds: Sequence[int] = (), merge_stderr: bool = False) -> tuple[int, str]:
    """Run `argv`, return (exit code, stdout); raise HostCommandError with stderr on failure.

    `stdin` is fed to the tool through a pipe: how a secret reaches it (QEMU's `file=/dev/stdin`), never argv.
    `pass_fds` stay open in the tool under their numbers (more secrets, each a pipe: `secret_pipes`).
    `merge_stderr`: stderr comes back with stdout (a tool that prints what we read there, e.g. a version).
    """
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE,
        env=tool_env(), pass_fds=pass_fds,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
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
