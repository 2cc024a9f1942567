"""Which vhost-user clients lack a back-end channel, judged from the ends QSD holds (no processes here)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from csi_qsd.sys.vhost_channels import End, inspect, judge

A = "/state/exports/vol-a/vhost/vhost-user-blk.sock"
B = "/state/exports/vol-b/vhost/vhost-user-blk.sock"
QMP = "/state/qsd/qmp.sock"


def is_export(name: str) -> bool:
    return name.endswith("/vhost-user-blk.sock")


def client(path: str, who: str, pid: int = 0) -> End:
    return End(path, "", who, pid)


def channel(who: str) -> End:
    return End("", "", who, 0)


def test_a_guest_with_its_channel_may_grow() -> None:
    verdict = judge([client(A, "qemu"), channel("qemu"), End(QMP, "", "driver", 1)], A, is_export)
    assert (verdict.clients, verdict.without_channel, verdict.exact) == (1, 0, True)


def test_a_client_without_a_channel_is_named_beside_a_guest_on_another_export() -> None:
    ends = [client(A, "qemu"), channel("qemu"), client(B, "qemu-io", pid=4321)]
    assert judge(ends, B, is_export).without_channel == 1
    assert judge(ends, B, is_export).pids == (4321,)
    assert judge(ends, A, is_export).without_channel == 0  # the guest's growth goes on


def test_one_process_with_two_connections_needs_two_channels() -> None:
    ends = [client(A, "vmm"), client(B, "vmm"), channel("vmm")]
    assert judge(ends, A, is_export).without_channel == 1 and judge(ends, B, is_export).without_channel == 1
    assert judge([*ends, channel("vmm")], A, is_export).without_channel == 0


def test_qsds_own_socket_pairs_are_no_channels() -> None:
    ends = [client(A, "qemu-io"), channel("qsd")]
    assert judge(ends, A, is_export, own="qsd").without_channel == 1


def test_peers_that_cannot_be_told_apart_count_as_one() -> None:
    ends = [client(A, ""), channel(""), client(B, "")]
    for path in (A, B):
        verdict = judge(ends, path, is_export)
        assert (verdict.without_channel, verdict.exact) == (1, False)
    assert judge([*ends, channel("")], A, is_export).without_channel == 0


def test_no_client_nothing_to_refuse() -> None:
    assert judge([client(B, "qemu-io")], A, is_export).clients == 0


def test_inspect_reads_a_process_s_socket_pair_and_connection(tmp_path: Path) -> None:
    """This process as the 'daemon': a connection named like an export, and a socket pair made by itself."""
    path = f"{tmp_path}/vhost-user-blk.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as out:
            out.connect(path)
            accepted, _ = listener.accept()
            left, right = socket.socketpair()
            with accepted, left, right:
                verdict = inspect(os.getpid(), Path(path), is_export)
    # This process is the client of its own connection and made its own pair: its pair is no channel.
    assert (verdict.clients, verdict.without_channel) == (1, 1)
