"""VOLUME_MOUNT_GROUP: the driver gives a filesystem to the pod's group as kubelet gives it a pod's fsGroup."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from csi_qsd.exports.fuse_loop import _apply_group


def _tree(root: Path, outside: Path) -> None:
    (root / "sub" / "deeper").mkdir(parents=True)
    for path in (root / "file", root / "sub" / "file", root / "sub" / "deeper" / "file"):
        path.write_text("x")
        path.chmod(0o600)
        os.chown(path, -1, 1000)
    for directory in (root, root / "sub", root / "sub" / "deeper"):
        directory.chmod(0o755)
        os.chown(directory, -1, 1000)
    (root / "link").symlink_to(outside)


def test_a_new_group_takes_every_file_and_directory_but_no_links_target(tmp_path: Path) -> None:
    """A pod of fsGroup 4000 after one of 1000 (a ReadWriteOncePod volume staged again): everything is 4000's."""
    root, outside = tmp_path / "volume", tmp_path / "outside"
    root.mkdir()
    outside.write_text("not the volume's")
    os.chown(outside, -1, 1000)
    _tree(root, outside)
    _apply_group(root, "4000")
    for path in (root, root / "sub", root / "sub" / "deeper"):
        st = os.stat(path)
        assert st.st_gid == 4000 and st.st_mode & 0o2070 == 0o2070, path
    for path in (root / "file", root / "sub" / "file", root / "sub" / "deeper" / "file"):
        st = os.stat(path)
        assert st.st_gid == 4000 and stat.S_IMODE(st.st_mode) == 0o660, path
    assert os.lstat(root / "link").st_gid == 4000
    assert os.stat(outside).st_gid == 1000  # the link's target is not the volume's


def test_a_root_already_the_groups_is_left_as_it_is_below(tmp_path: Path) -> None:
    """Like kubelet's OnRootMismatch: the same group again walks nothing (a big volume stages fast)."""
    root = tmp_path / "volume"
    root.mkdir()
    _tree(root, tmp_path)
    os.chown(root, -1, 4000)
    _apply_group(root, "4000")
    assert os.stat(root / "sub" / "file").st_gid == 1000
    assert os.stat(root).st_mode & 0o2070 == 0o2070


def test_a_directory_swapped_for_a_link_mid_walk_leads_nowhere_outside(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod racing the walk renames `sub` away and puts a link to a host directory in its place just before
    the walk lists it: nothing in the host directory changes group or mode."""
    root, host = tmp_path / "volume", tmp_path / "host"
    root.mkdir()
    host.mkdir()
    secret = host / "shadow"
    secret.write_text("host file")
    secret.chmod(0o600)
    os.chown(secret, -1, 0)
    _tree(root, tmp_path / "nothing")
    real_scandir = os.scandir
    listed: list[object] = []

    def racing(path: Any = ".") -> Any:
        listed.append(path)
        if len(listed) == 2:  # the first directory below the root: swapped under the walk
            (root / "sub").rename(root / "sub.moved")
            (root / "sub").symlink_to(host)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", racing)
    _apply_group(root, "4000")
    assert os.stat(secret).st_gid == 0 and stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert os.stat(root / "sub.moved" / "file").st_gid == 4000  # the real directory was walked, by descriptor
