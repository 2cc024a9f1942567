"""Files a backup tool makes or removes: backups private to their owner, and an export's socket path that is
never anything but a socket when the driver removes it."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from csi_qsd.backup.incremental import private_file
from csi_qsd.backup.snapshot_nbd import remove_stale_socket
from csi_qsd.errors import InvalidArgument


def test_a_backup_file_is_made_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        private_file(tmp_path / "b.qcow2")
        (tmp_path / "left").write_bytes(b"from an earlier run")
        os.chmod(tmp_path / "left", 0o644)
        private_file(tmp_path / "left")
    finally:
        os.umask(old)
    for name in ("b.qcow2", "left"):
        st = os.lstat(tmp_path / name)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 0, name


def test_an_export_socket_path_holding_anything_else_is_refused_and_kept(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("data")
    link = tmp_path / "link"
    link.symlink_to(precious)
    (tmp_path / "dir").mkdir()
    for path in (precious, link, tmp_path / "dir"):
        with pytest.raises(InvalidArgument, match="is not a socket") as err:
            remove_stale_socket(path)
        assert str(path) in str(err.value) and "nothing was removed" in str(err.value)
        assert os.path.lexists(path)
    assert precious.read_text() == "data"
    remove_stale_socket(tmp_path / "missing")  # nothing there: fine


def test_a_stale_socket_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "s.nbd"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    remove_stale_socket(path)
    assert not os.path.lexists(path)
