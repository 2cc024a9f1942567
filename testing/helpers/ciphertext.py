"""What an encrypted volume's image files hold: a LUKS header, and none of what was written through the volume."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

CHUNK = 4 << 20


def marker() -> bytes:
    """A pattern no image holds by chance."""
    return b"PLAINTEXT-" + secrets.token_hex(8).encode() + b"-"


def holds(path: Path, needle: bytes) -> bool:
    """Whether `needle` is anywhere in the file at `path` (read in overlapping chunks)."""
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(CHUNK):
            if needle in tail + chunk:
                return True
            tail = chunk[-len(needle):]
    return False


def luks(image: Path) -> bool:
    """Whether qemu-img reports `image` as a qcow2 with a LUKS header."""
    out = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(image)], capture_output=True, check=True,
                         text=True, env=dict(os.environ, LC_ALL="C")).stdout
    info = json.loads(out)
    return bool(info.get("encrypted")) and info["format-specific"]["data"]["encrypt"]["format"] == "luks"
