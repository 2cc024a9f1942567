"""Is it ciphertext: a known pattern searched for in a file's bytes, and whether an image is LUKS-encrypted.

What an encrypted volume's pods write must be in no image file of the pool,
no backup file and no restored image: each is searched for a marker the
test wrote, and `qemu-img info` must report each as LUKS.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

MIB = 1 << 20


def marker() -> bytes:
    """A pattern no image holds by chance."""
    return b"PLAINTEXT-" + secrets.token_hex(8).encode() + b"-"


def holds(path: Path, needle: bytes) -> bool:
    """Whether `needle` is anywhere in the file at `path` (read in overlapping chunks)."""
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(4 * MIB):
            if needle in tail + chunk:
                return True
            tail = chunk[-len(needle):]
    return False


def luks(image: Path) -> bool:
    """Whether `qemu-img info` reports `image` as a qcow2 encrypted with LUKS."""
    out = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(image)], capture_output=True, check=True,
                         text=True, env=dict(os.environ, LC_ALL="C")).stdout
    info = json.loads(out)
    return bool(info.get("encrypted")) and info["format-specific"]["data"]["encrypt"]["format"] == "luks"
