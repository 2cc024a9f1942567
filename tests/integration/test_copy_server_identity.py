"""A copy server (a real qemu-nbd, as `nbd_tcp.start` runs it) lets in one certificate subject, exactly.

The subject it is given is the one the driver writes from the lease's
node's certificate (`csi_qsd.sys.x509_name`), so these prove two things at
once: that GnuTLS writes those certificates' names as the driver does (the
right node gets in), and that a certificate of the same CA whose name only
contains the node's (an OU of `x,CN=node-b`) or that differs in any other
attribute (a SPIRE unique identifier) does not.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID, ObjectIdentifier

from csi_qsd.qcow2.imagemap import qcow2_spec
from csi_qsd.sys import nbd_tcp, x509_name
from csi_qsd.sys.run import run
from csi_qsd.sys.tools import bundled
from csi_qsd.transport.tls import PemFiles
from testing.certs import Pki, crafted_intruder, mint
from testing.harness import free_port
from testing.helpers.nbd_tls import nbd_info

EXPORT = "vol-0123456789abcdef01234567"


def _spire(pki: Pki, name: str, unique: str, file_name: str) -> PemFiles:
    """An SVID-shaped certificate: `C=US,O=SPIRE,CN=<name>,x500UniqueIdentifier=<unique>` and its SPIFFE ID."""
    subject = x509.Name([
        x509.NameAttribute(NameOID.COUNTRY_NAME, "US"), x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SPIRE"),
        x509.NameAttribute(NameOID.COMMON_NAME, name), x509.NameAttribute(ObjectIdentifier("2.5.4.45"), unique)])
    return pki.cluster.issue(name, server=True, dns_names=(name,), subject=subject, file_name=file_name,
                             uris=(f"spiffe://cluster.local/ns/csi-qsd/csi-qsd/node/{name}",))


@contextlib.asynccontextmanager
async def _server(tmp_path: Path, pki: Pki, admit: PemFiles) -> AsyncIterator[int]:
    """Node A's copy server for one 1 MiB snapshot, letting in the subject of `admit`'s certificate; its port."""
    image = tmp_path / "snap.qcow2"
    await run(bundled("qemu-img"), "create", "-q", "-f", "qcow2", str(image), "1M")
    a = pki.for_node("node-a")
    port, pid_file = free_port(), tmp_path / "nbd.pid"
    subject = x509_name.pem_subject(admit.cert.read_bytes())
    async with nbd_tcp.credentials(tmp_path / "run", a.cert, a.key, a.ca, endpoint="server") as tls:
        await nbd_tcp.start(bundled("qemu-nbd"), qcow2_spec(image, read_only=True), host="127.0.0.1", port=port,
                            export=EXPORT, tls=tls, pid_file=pid_file, admit=subject)
    try:
        yield port
    finally:
        await nbd_tcp.stop(pid_file, port)


async def _reads(port: int, files: PemFiles, directory: Path) -> bool:
    """Whether `qemu-img info` opens the export presenting `files`."""
    opened, out, _ = await nbd_info(f"127.0.0.1:{port}", EXPORT, files, directory)
    return opened and "virtual size: 1 MiB" in out


async def test_a_plain_node_certificate_gets_in_and_a_crafted_one_does_not(tmp_path: Path) -> None:
    """Per-node certificates: node-b reads; a certificate of the same CA for `intruder` with an OU of
    `x,CN=node-b` (`CN=intruder,OU=x\\,CN=node-b`, which a glob `*,CN=node-b` matched) and node-c do not."""
    pki = mint(tmp_path / "pki")
    b = pki.for_node("node-b")
    async with _server(tmp_path, pki, b) as port:
        assert await _reads(port, b, tmp_path / "b")
        assert not await _reads(port, crafted_intruder(pki), tmp_path / "intruder")
        assert not await _reads(port, pki.for_node("node-c"), tmp_path / "c")


async def test_an_svid_gets_in_and_another_with_the_same_common_name_does_not(tmp_path: Path) -> None:
    """SPIRE: node-b's SVID reads; another SVID whose common name is also node-b (a DNS name template another
    workload controls) differs in its unique identifier and does not."""
    pki = mint(tmp_path / "pki")
    b = _spire(pki, "node-b", "3f1c9a", "svid-b")
    async with _server(tmp_path, pki, b) as port:
        assert await _reads(port, b, tmp_path / "b")
        assert not await _reads(port, _spire(pki, "node-b", "77aa01", "svid-other"), tmp_path / "other")
        assert not await _reads(port, pki.for_node("node-b"), tmp_path / "plain")  # `CN=node-b` is another subject
