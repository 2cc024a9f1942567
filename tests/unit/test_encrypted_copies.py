"""An encrypted volume copied from another node: the link names the source's image file, opened here with the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csi_qsd.copy_terms import PEER_TLS_OBJECT, nbd_backing
from csi_qsd.errors import FailedPrecondition
from csi_qsd.params import VolumeParameters
from csi_qsd.qcow2 import blank, layer_bitmaps
from csi_qsd.qsd import encryption
from csi_qsd.qsd.block_jobs import format_node_of
from csi_qsd.qsd.client import BlockNodeInfo
from csi_qsd.transport.copy_peers import checked_lease

COPY = "vol-0123456789abcdef01234567"
ANSWER = {"snapshot_id": "snap-0123456789abcdef01234567", "address": "10.0.0.5:10900", "export": COPY,
          "size": 1 << 26, "ttl": 60}


def _image(path: Path, backing: str, backing_format: str) -> Path:
    with open(path, "wb") as f:
        blank.write(f.fileno(), blank.image_bytes(1 << 26, 1 << 16, layer_bitmaps.OWN, backing=backing,
                                                  backing_format=backing_format))
    return path


def test_an_encrypted_link_opens_the_source_image_file_as_qcow2() -> None:
    spec = json.loads(nbd_backing("10.0.0.7:10901", COPY, "node-a", encrypted=True)[5:])
    assert spec["driver"] == "qcow2" and spec["file"]["driver"] == "nbd"
    assert spec["file"]["tls-creds"] == PEER_TLS_OBJECT and "encrypt" not in json.dumps(spec)  # the key: at open
    assert json.loads(nbd_backing("10.0.0.7:10901", COPY, "node-a")[5:])["driver"] == "raw"


def test_a_lease_says_whether_it_serves_an_encrypted_image_file() -> None:
    assert checked_lease("node-a", "10.0.0.5:9811", COPY, {**ANSWER, "encrypted": True}).encrypted
    assert not checked_lease("node-a", "10.0.0.5:9811", COPY, ANSWER).encrypted  # an earlier version's answer
    with pytest.raises(ValueError, match="not true or false"):
        checked_lease("node-a", "10.0.0.5:9811", COPY, {**ANSWER, "encrypted": "yes"})


def test_an_encrypted_copy_s_chain_ends_in_the_keyed_link_and_its_copy_image_may_be_streamed_into(
        tmp_path: Path) -> None:
    link = nbd_backing("10.0.0.7:10901", COPY, "node-a", encrypted=True)
    copy = _image(tmp_path / f"{COPY}-copy.qcow2", link, "qcow2")
    top = _image(tmp_path / f"{COPY}.qcow2", copy.name, "qcow2")
    chain = encryption.chain_below(top)
    assert chain[0] == copy and isinstance(chain[1], dict) and chain[1]["file"]["driver"] == "nbd"
    spec = encryption.backing_spec(chain, VolumeParameters(), "cq-k", "threads")
    assert isinstance(spec, dict)
    assert spec["encrypt"]["key-secret"] == "cq-k" and spec["backing"]["encrypt"]["key-secret"] == "cq-k"
    # block-stream reopens the copy image writable: its file is read-only only as a backing is, not explicitly.
    assert spec["file"]["filename"] == str(copy) and "read-only" not in spec["file"]
    assert spec["backing"]["file"]["read-only"] is True and spec["backing"]["file"]["driver"] == "nbd"


def test_an_encrypted_chain_refuses_a_plain_link(tmp_path: Path) -> None:
    copy = _image(tmp_path / "c.qcow2", nbd_backing("10.0.0.7:10901", COPY, "node-a"), "raw")
    top = _image(tmp_path / "t.qcow2", copy.name, "qcow2")
    with pytest.raises(FailedPrecondition, match="only for an encrypted image another node serves"):
        encryption.chain_below(top)


def test_a_keyed_layer_is_found_by_the_file_its_pseudo_name_holds() -> None:
    pseudo = "json:" + json.dumps({"encrypt": {"key-secret": "cq-k"}, "driver": "qcow2",
                                   "file": {"driver": "file", "filename": "/pool/c.qcow2"}})
    nodes = {"#block7": BlockNodeInfo(node_name="#block7", drv="qcow2", file=pseudo, ro=True, virtual_size=1),
             "#block8": BlockNodeInfo(node_name="#block8", drv="file", file="/pool/c.qcow2", ro=True, virtual_size=1)}
    assert format_node_of(nodes, "/pool/c.qcow2") == "#block7"
    assert format_node_of(nodes, "/pool/other.qcow2") == ""


def test_a_lease_lists_the_addresses_of_its_older_layers_each_on_the_peer_s_host() -> None:
    lease = checked_lease("node-a", "10.0.0.5:9811", COPY,
                          {**ANSWER, "encrypted": True, "older": ["10.0.0.5:10901", "10.0.0.5:10902"]})
    assert lease.older == ("10.0.0.5:10901", "10.0.0.5:10902")
    assert checked_lease("node-a", "10.0.0.5:9811", COPY, ANSWER).older == ()  # an earlier version: one image
    with pytest.raises(ValueError, match="not on the peer's host"):
        checked_lease("node-a", "10.0.0.5:9811", COPY, {**ANSWER, "older": ["10.0.0.66:10901"]})
    with pytest.raises(ValueError, match="not a list"):
        checked_lease("node-a", "10.0.0.5:9811", COPY, {**ANSWER, "older": "10.0.0.5:10901"})


def test_a_link_to_a_chain_reads_its_older_layers_as_named_nodes_each_keyed(tmp_path: Path) -> None:
    """QEMU resolves a layer given as options through its header's relative backing name, which a layer read over
    NBD cannot: the link and its older layers are nodes of their own, the copy image's backing names the link's."""
    link = nbd_backing("10.0.0.7:10901", COPY, "node-a", encrypted=True, older=("10.0.0.7:10902", "10.0.0.7:10903"))
    copy = _image(tmp_path / f"{COPY}-copy.qcow2", link, "qcow2")
    top = _image(tmp_path / f"{COPY}.qcow2", copy.name, "qcow2")
    chain = encryption.chain_below(top)
    spec = encryption.backing_spec(chain, VolumeParameters(), "cq-k", "threads", link="cq-l")
    assert isinstance(spec, dict) and spec["backing"] == "cq-l1"  # the copy image over the link's node
    older = encryption.link_layers(chain, "cq-k", "cq-l")  # oldest first: each over the next by its name
    assert [(o["node-name"], o["backing"], o["file"]["server"]["port"]) for o in older] == [
        ("cq-l3", None, "10903"), ("cq-l2", "cq-l3", "10902"), ("cq-l1", "cq-l2", "10901")]
    for layer in older:
        assert layer["encrypt"]["key-secret"] == "cq-k" and layer["read-only"] is True
        assert layer["file"]["read-only"] is True and layer["file"]["driver"] == "nbd"
    single = _image(tmp_path / "s.qcow2", nbd_backing("10.0.0.7:10901", COPY, "node-a", encrypted=True), "qcow2")
    assert encryption.link_layers(encryption.chain_below(_image(tmp_path / "t.qcow2", single.name, "qcow2")),
                                  "cq-k", "cq-l") == []


def test_an_encrypted_chain_refuses_a_plain_layer_below_a_link(tmp_path: Path) -> None:
    spec = json.loads(nbd_backing("10.0.0.7:10901", COPY, "node-a", encrypted=True)[5:])
    spec["backing"] = json.loads(nbd_backing("10.0.0.7:10902", COPY, "node-a")[5:])  # raw: data, not a layer
    copy = _image(tmp_path / "c.qcow2", "json:" + json.dumps(spec), "qcow2")
    top = _image(tmp_path / "t.qcow2", copy.name, "qcow2")
    with pytest.raises(FailedPrecondition, match="only for an encrypted image another node serves"):
        encryption.chain_below(top)
