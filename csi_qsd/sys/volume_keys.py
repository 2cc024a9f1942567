"""The keys of encrypted volumes while they are staged here: in memory, and in a tmpfs file each for restarts.

A staged encrypted volume may have to be opened again without a new
NodeStageVolume: after a QSD crash (the rebuild), for a snapshot's overlay
(a new layer needs the key to make its LUKS header) and for a restore or a
clone cut from it. The key comes with NodeStageVolume and goes at
NodeUnstageVolume. A volume copied from another node needs it too while
its copy fills (which a restarted driver resumes): that key comes with
CreateVolume and goes once the copy is whole and the volume not staged.
It is kept in this process's memory and, so that a
driver restarted while QSD runs can still rebuild after a later QSD crash,
in one file per volume (mode 0600) under `--runtime-dir`/keys (0700): the
runtime directory is tmpfs in the manifests, so a key never reaches a disk,
and it goes with the node pod. This module must never log a key, put one in
an exception message or on a command line; `VolumeKey` prints as `<key>`.
"""

from __future__ import annotations

import base64
import hmac
import os
from pathlib import Path

from csi_qsd.sys import durable

KEYS_DIR = "keys"


class VolumeKey:
    """A volume's passphrase (the Secret's text): compared in constant time, never printed."""

    __slots__ = ("_text",)

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return "<key>"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VolumeKey) and hmac.compare_digest(self._text.encode(), other._text.encode())

    def __hash__(self) -> int:
        return 0  # equal keys must hash alike; a key is never a good dict key anyway

    def base64(self) -> str:
        """The passphrase as QEMU's `secret` object takes it with `format=base64` (UTF-8 bytes)."""
        return base64.b64encode(self._text.encode()).decode()

    def utf8(self) -> bytes:
        return self._text.encode()


class KeyStore:
    """The keys of the volumes staged on this node; `directory` (on tmpfs) keeps them across driver restarts."""

    def __init__(self, directory: Path | None) -> None:
        self._directory = directory
        self._keys: dict[str, VolumeKey] = {}

    def _path(self, volume_id: str) -> Path | None:
        return self._directory / volume_id if self._directory is not None else None

    def put(self, volume_id: str, key: VolumeKey) -> None:
        """Hold `key` for `volume_id` (replacing one held). Raises OSError if its file cannot be written."""
        self._keys[volume_id] = key
        path = self._path(volume_id)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path.parent, 0o700)
        durable.create(path, lambda fd: os.write(fd, key.utf8()), sync=False)

    def get(self, volume_id: str) -> VolumeKey | None:
        """The key held for `volume_id`, from memory or from its file (a restarted driver); None if none."""
        key = self._keys.get(volume_id)
        path = self._path(volume_id)
        if key is None and path is not None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                key = VolumeKey(os.read(fd, 1 << 16).decode())
            finally:
                os.close(fd)
            self._keys[volume_id] = key
        return key

    def keep_only(self, volume_ids: set[str]) -> None:
        """Remove the key files of volumes not in `volume_ids` (unstaged while no driver ran)."""
        if self._directory is None or not self._directory.is_dir():
            return
        for path in self._directory.iterdir():
            if path.name not in volume_ids:
                path.unlink(missing_ok=True)

    def forget(self, volume_id: str) -> None:
        """Drop the key of `volume_id` (unstaged): from memory and its file."""
        self._keys.pop(volume_id, None)
        path = self._path(volume_id)
        if path is not None:
            path.unlink(missing_ok=True)
