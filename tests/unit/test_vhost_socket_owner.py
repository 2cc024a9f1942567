"""The vhost-user-blk socket and its directory get their owner and mode through a descriptor that never follows a
link: a symbolic link swapped in for QSD's socket (from the pod, which sees the directory) is refused and the
file it points at keeps its owner and mode."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from csi_qsd.errors import FailedPrecondition
from csi_qsd.publish import vhost_user


def made_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))


def test_the_socket_and_its_directory_go_to_root_and_the_group(tmp_path: Path) -> None:
    directory = tmp_path / "vhost"
    vhost_user.prepare_dir(directory, "107")
    made_socket(directory / vhost_user.SOCKET_NAME)
    vhost_user.restrict_socket(directory / vhost_user.SOCKET_NAME, "107")
    for path, mode in ((directory, 0o750), (directory / vhost_user.SOCKET_NAME, 0o660)):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 107, mode), path
    vhost_user.restrict_socket(directory / vhost_user.SOCKET_NAME, "")
    st = os.lstat(directory / vhost_user.SOCKET_NAME)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0o600)


@pytest.mark.parametrize("swapped_in", ["symlink", "file", "hardlink"])
def test_anything_but_a_socket_is_refused_and_left_alone(tmp_path: Path, swapped_in: str) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("root's")
    os.chmod(secret, 0o600)
    os.chown(secret, 0, 0)
    directory = tmp_path / "vhost"
    vhost_user.prepare_dir(directory, "107")
    sock = directory / vhost_user.SOCKET_NAME
    if swapped_in == "symlink":
        sock.symlink_to(secret)
    elif swapped_in == "hardlink":
        os.link(secret, sock)
    else:
        sock.write_text("not a socket")
    with pytest.raises(FailedPrecondition, match="not a socket") as err:
        vhost_user.restrict_socket(sock, "107")
    assert str(sock) in str(err.value)
    st = os.stat(secret)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)


def test_a_socket_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "vhost").symlink_to(elsewhere)
    with pytest.raises(FailedPrecondition, match="not a directory"):
        vhost_user.prepare_dir(tmp_path / "vhost", "107")
    assert stat.S_IMODE(os.stat(elsewhere).st_mode) == 0o700 and os.stat(elsewhere).st_gid == 0


def test_a_hidden_socket_is_out_of_the_pods_sight_and_comes_back(tmp_path: Path) -> None:
    """`hide` moves the socket out of the directory the pod sees; `unhide` puts it back, also after a crash in
    between (a stage finds it hidden); one QSD made again meanwhile is kept and the hidden one removed."""
    directory = tmp_path / "vhost"
    vhost_user.prepare_dir(directory, "")
    socket_path = directory / vhost_user.SOCKET_NAME
    made_socket(socket_path)
    vhost_user.hide(directory)
    assert os.listdir(directory) == [] and stat.S_ISSOCK(os.lstat(tmp_path / vhost_user.HIDDEN_NAME).st_mode)
    with socket.socket(socket.AF_UNIX) as sock, pytest.raises(FileNotFoundError):
        sock.connect(str(socket_path))
    vhost_user.unhide(directory)
    assert stat.S_ISSOCK(os.lstat(socket_path).st_mode) and not (tmp_path / vhost_user.HIDDEN_NAME).exists()
    vhost_user.unhide(directory)  # nothing hidden: nothing to do
    vhost_user.hide(directory)
    made_socket(socket_path)  # QSD restarted and listens again at the path
    vhost_user.unhide(directory)
    assert stat.S_ISSOCK(os.lstat(socket_path).st_mode) and not (tmp_path / vhost_user.HIDDEN_NAME).exists()
