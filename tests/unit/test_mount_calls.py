"""mount(8)-style option names split into the kernel's MS_* flags and the filesystem's data string; mount roots."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi_qsd.sys import mount_calls as mc
from csi_qsd.sys import mounts


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


def test_mount_roots_agree_with_the_mount_table(tmp_path: Path) -> None:
    """statx's answer is the one mountinfo gives: every mount point is a mount root, a plain file or
    directory (or a missing path) is not."""
    table = mounts.mount_table()
    assert table and all(mc.is_mount_root(entry.mount_point) in (True, None) for entry in table)
    plain = tmp_path / "file"
    plain.write_text("x")
    for path in (tmp_path, plain, tmp_path / "missing", plain / "below"):
        assert mc.is_mount_root(path) in (False, None)
        assert mounts.mounted_at(path) is None
