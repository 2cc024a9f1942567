"""Checks on everything a request carries before the driver acts on it.

IDs are matched against strict patterns and never concatenated into paths
unchecked; paths from requests must lie under the configured target root and
must not reach the driver's own state or pool. Pure functions, no I/O except
resolving symlinks of a path's existing parents.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from csi_qsd.errors import InvalidArgument, NotFound

# 96 random bits: short enough that QEMU node names built from it stay within 31 characters.
ID_HEX_DIGITS = 24
# Patterns end in \Z, not $: "$" also matches before a trailing newline.
VOLUME_ID_RE = re.compile(r"^vol-[0-9a-f]{24}\Z")
GROUP_ID_RE = re.compile(r"^group-[0-9a-f]{24}\Z")
SNAPSHOT_ID_RE = re.compile(r"^snap-[0-9a-f]{24}\Z")
# Kubernetes gives "pvc-<uuid>"; other COs give anything printable. 128 bytes is the CSI limit.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")
MOUNT_FLAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_=.:+-]{0,127}\Z")
# Flags that would change what is mounted, not how: the driver decides those itself.
FORBIDDEN_MOUNT_FLAGS = frozenset({"bind", "rbind", "remount", "move", "loop", "defaults"})
MAX_PATH = 4096


def new_volume_id() -> str:
    return f"vol-{uuid.uuid4().hex[:ID_HEX_DIGITS]}"


def new_snapshot_id() -> str:
    return f"snap-{uuid.uuid4().hex[:ID_HEX_DIGITS]}"


def new_group_id() -> str:
    return f"group-{uuid.uuid4().hex[:ID_HEX_DIGITS]}"


def volume_id(value: str, field: str = "volume_id") -> str:
    """Return a request's volume ID, or raise.

    Raises InvalidArgument when empty; NotFound when it cannot be one of ours
    (the spec wants NOT_FOUND for an ID the plugin does not know).
    """
    if not value:
        raise InvalidArgument(f"{field} is required")
    if not VOLUME_ID_RE.match(value):
        raise NotFound(f"volume {value!r} does not exist (not an ID this driver issues)")
    return value


def snapshot_id(value: str, field: str = "snapshot_id") -> str:
    """Return a request's snapshot ID, or raise like `volume_id`."""
    if not value:
        raise InvalidArgument(f"{field} is required")
    if not SNAPSHOT_ID_RE.match(value):
        raise NotFound(f"snapshot {value!r} does not exist (not an ID this driver issues)")
    return value


def name(value: str, field: str = "name") -> str:
    if not value:
        raise InvalidArgument(f"{field} is required")
    if not NAME_RE.match(value):
        raise InvalidArgument(
            f"{field} {value!r} is invalid: use at most 128 letters, digits, '.', '_', ':' or '-'"
        )
    return value


def request_path(value: str, field: str, *, root: Path, forbidden: tuple[Path, ...]) -> Path:
    """Return a staging or target path from a request, proven to lie strictly below `root`.

    The path must be absolute and normalised, and neither it nor any existing
    parent (dangling symlinks included) may resolve outside `root`, onto `root`
    itself or into `forbidden`.
    Raises InvalidArgument naming the field.
    """
    if not value:
        raise InvalidArgument(f"{field} is required")
    if len(value) > MAX_PATH or "\x00" in value:
        raise InvalidArgument(f"{field} is too long or holds a NUL byte")
    if not value.startswith("/"):
        raise InvalidArgument(f"{field} {value!r} must be an absolute path")
    if os.path.normpath(value) != value:
        raise InvalidArgument(f"{field} {value!r} must be normalised (no '..', '.', '//' or trailing '/')")
    path = Path(value)
    if not _is_under(path, root):
        raise InvalidArgument(f"{field} {value!r} is outside the allowed root {str(root)!r}")
    if path == root:
        raise InvalidArgument(f"{field} {value!r} is the allowed root itself; it must lie below it")
    try:
        resolved = _resolve_existing(path)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11's pathlib)
        raise InvalidArgument(f"{field} {value!r} cannot be resolved: {exc}") from None
    if resolved == root or not _is_under(resolved, root):
        raise InvalidArgument(f"{field} {value!r} resolves to {str(resolved)!r}, not below {str(root)!r}")
    for place in forbidden:
        if _is_under(resolved, place) or _is_under(place, resolved):
            raise InvalidArgument(f"{field} {value!r} overlaps the driver's own directory {str(place)!r}")
    return path


def mount_flags(flags: list[str]) -> list[str]:
    """Return mount flags after rejecting ones that are malformed or would change the mount's source."""
    for flag in flags:
        if not MOUNT_FLAG_RE.match(flag):
            raise InvalidArgument(f"mount flag {flag!r} is malformed")
        if flag.split("=", 1)[0] in FORBIDDEN_MOUNT_FLAGS:
            raise InvalidArgument(f"mount flag {flag!r} is not allowed: the driver chooses how it mounts")
    return list(flags)


def _is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _resolve_existing(path: Path) -> Path:
    """Resolve symlinks in the longest existing prefix of `path`, keep the rest as written.

    A dangling symlink counts as existing (lexists), so it is resolved too: a
    later mkdir, touch or mount through it would land wherever it points.
    """
    existing = path
    rest: list[str] = []
    while not os.path.lexists(existing) and existing != existing.parent:
        rest.insert(0, existing.name)
        existing = existing.parent
    return existing.resolve().joinpath(*rest)


# host:port or [v6]:port.
_ADDRESS_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}\Z")


def check_address(text: str, what: str) -> str:
    """Return host:port, or raise ValueError naming `what`."""
    if not _ADDRESS_RE.match(text) or not 0 < int(text.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"{what} {text!r}: expected HOST:PORT")
    return text
