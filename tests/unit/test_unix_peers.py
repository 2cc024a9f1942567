"""The kernel's view of a listening UNIX socket's clients (sock_diag), on real sockets."""

from __future__ import annotations

import socket
from pathlib import Path

from csi_qsd.sys import unix_peers


def test_clients_are_counted_while_connected_and_not_once_the_peer_closed(tmp_path: Path) -> None:
    path = tmp_path / "export.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(4)
        assert unix_peers.peers(path) == unix_peers.Peers(listening=True, clients=0)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        served, _ = listener.accept()
        with served:
            assert unix_peers.peers(path) == unix_peers.Peers(listening=True, clients=1)
            client.close()
            # The server has not closed its end yet: the client is gone all the same.
            assert unix_peers.peers(path) == unix_peers.Peers(listening=True, clients=0)
        assert unix_peers.peers(tmp_path / "other.sock") == unix_peers.Peers(listening=False, clients=0)
    assert unix_peers.peers(path) == unix_peers.Peers(listening=False, clients=0)


def test_a_half_closed_client_still_counts(tmp_path: Path) -> None:
    path = tmp_path / "export.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            served, _ = listener.accept()
            with served:
                client.shutdown(socket.SHUT_WR)  # it still reads: still a client
                assert unix_peers.peers(path).clients == 1


def test_unbound_and_abstract_sockets_are_not_in_the_table() -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as abstract:
        abstract.bind("\0csi-qsd-test-abstract")
        abstract.listen(1)
        assert not [end for end in unix_peers.table() if "csi-qsd-test-abstract" in end.path]


def test_connections_not_yet_accepted_are_waiting_and_a_renamed_socket_keeps_its_address(tmp_path: Path) -> None:
    """A listener's backlog is told apart from its clients; renaming the socket file (hiding it for a resize)
    changes neither what the table says of it nor the connections made before."""
    path = tmp_path / "export.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener, early:
        listener.bind(str(path))
        listener.listen(4)
        early.connect(str(path))
        path.rename(tmp_path / "hidden.sock")
        assert unix_peers.peers(path) == unix_peers.Peers(listening=True, clients=0, waiting=1)
        served, _ = listener.accept()
        with served:
            assert unix_peers.peers(path) == unix_peers.Peers(listening=True, clients=1, waiting=0)
