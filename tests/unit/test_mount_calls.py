"""mount(8)-style option names split into the kernel's MS_* flags and the filesystem's data string."""

from __future__ import annotations

import pytest

from csi_qsd.sys import mount_calls as mc


@pytest.mark.parametrize("options, flags, data", [
    ([], 0, ""),
    (["ro"], mc.MS_RDONLY, ""),
    (["ro", "rw"], 0, ""),  # left to right, as mount(8) reads them
    (["noatime", "nosuid", "nodev", "noexec"], mc.MS_NOATIME | mc.MS_NOSUID | mc.MS_NODEV | mc.MS_NOEXEC, ""),
    (["nouuid"], 0, "nouuid"),
    (["data=journal", "ro", "discard"], mc.MS_RDONLY, "data=journal,discard"),
    (["nofail", "x-kubernetes.io=1", "comment=x", "_netdev"], 0, ""),
    (["relatime", "lazytime", "sync", "dirsync"], mc.MS_RELATIME | mc.MS_LAZYTIME | mc.MS_SYNCHRONOUS | mc.MS_DIRSYNC, ""),
])
def test_options_split_like_mount8(options: list[str], flags: int, data: str) -> None:
    assert mc.split_options(options) == (flags, data)
