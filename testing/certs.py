"""Certificates for mutual-TLS tests, minted per test: a CA, node and router certificates, and a stranger's.

Each node plugin has a certificate of its own (`Pki.for_node`): its common
name and a DNS name are the node name, beside the one name all node
plugins share for the router (`csi-qsd-node`) and 127.0.0.1. `Pki.node`
is a node certificate for tests with one node. The stranger has its own CA,
so its certificate is well-formed and signed, just not by the CA the node
plugins and the router trust.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from csi_qsd.router.config import DEFAULT_SERVER_NAME
from csi_qsd.transport.tls import ROUTER_NAME, PemFiles

Key = ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str | x509.Name, issuer: x509.Name, key: Key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject) if isinstance(subject, str) else subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


@dataclasses.dataclass
class Authority:
    """A CA that signs leaf certificates into `directory`."""

    directory: Path
    name: str
    key: Key = dataclasses.field(init=False)
    cert: x509.Certificate = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (_builder(self.name, _name(self.name), self.key)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    @property
    def ca_path(self) -> Path:
        return self.directory / f"{self.name}-ca.crt"

    def issue(self, common_name: str, *, server: bool, trusts: "Authority | None" = None,
              dns_names: tuple[str, ...] = (DEFAULT_SERVER_NAME,), uris: tuple[str, ...] = (),
              subject: x509.Name | None = None, file_name: str = "") -> PemFiles:
        """A leaf certificate (server: for `dns_names` and 127.0.0.1; `uris` as URI SANs, a SPIFFE ID) and the CA
        its holder trusts. `subject` replaces the plain `CN=common_name` (a crafted distinguished name), and
        `file_name` the files' name (default the common name)."""
        key = ec.generate_private_key(ec.SECP256R1())
        # A node plugin's certificate serves its listener and, for copies across nodes, calls other nodes.
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else [
            ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (_builder(subject or common_name, self.cert.subject, key)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
        names: list[x509.GeneralName] = [*map(x509.UniformResourceIdentifier, uris)]
        if server:
            names += [*map(x509.DNSName, dns_names), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        stem = file_name or common_name
        cert_path, key_path = self.directory / f"{stem}.crt", self.directory / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
        return PemFiles(cert_path, key_path, (trusts or self).ca_path)


@dataclasses.dataclass
class Pki:
    """Everything one mutual-TLS test needs: the node plugins', the router's and a stranger's files."""

    node: PemFiles
    router: PemFiles
    stranger: PemFiles
    cluster: Authority

    def for_node(self, name: str) -> PemFiles:
        """Node `name`'s own certificate (made once): its common name and a DNS name are `name`."""
        cert = self.cluster.directory / f"{name}.crt"
        if cert.exists():
            return PemFiles(cert, cert.with_suffix(".key"), self.cluster.ca_path)
        return self.cluster.issue(name, server=True, dns_names=(name, DEFAULT_SERVER_NAME))


def mint(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    cluster = Authority(directory, "cluster")
    other = Authority(directory, "other")
    return Pki(node=cluster.issue("node", server=True), router=cluster.issue(ROUTER_NAME, server=False),
               stranger=other.issue("stranger", server=False, trusts=cluster), cluster=cluster)


def crafted_intruder(pki: Pki) -> PemFiles:
    """A certificate of the cluster CA for `intruder` whose OU holds `x,CN=node-b`: its distinguished name, as
    GnuTLS writes it (`CN=intruder,OU=x\\,CN=node-b`), ends like node-b's, so a glob on the DN would let it in."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "intruder"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "x,CN=node-b")])
    return pki.cluster.issue("intruder", server=True, dns_names=("intruder",), subject=subject,
                             file_name="crafted-intruder")
