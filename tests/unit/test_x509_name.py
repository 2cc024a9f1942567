"""sys.x509_name: a certificate's subject as GnuTLS writes it, for qemu-nbd's exact `authz-simple` match.

The expected strings are what qemu-nbd 10.0.13 printed for the same subjects ("TLS x509 authz check for
... is denied"); tests/integration/test_copy_server_identity.py checks them against a running qemu-nbd.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID, ObjectIdentifier

from csi_qsd.sys import x509_name
from testing.certs import crafted_intruder, mint

A = x509.NameAttribute


@pytest.mark.parametrize(("subject", "written"), [
    (x509.Name([A(NameOID.COMMON_NAME, "node-b")]), "CN=node-b"),
    (x509.Name([A(NameOID.COUNTRY_NAME, "US"), A(NameOID.ORGANIZATION_NAME, "SPIRE"),
                A(NameOID.COMMON_NAME, "node-b"), A(ObjectIdentifier("2.5.4.45"), "0c3f5e2a9b")]),
     "C=US,O=SPIRE,CN=node-b,2.5.4.45=#0c0a30633366356532613962"),
    (x509.Name([A(NameOID.COMMON_NAME, 'a+b"c\\d<e>f;g # é')]), 'CN=a\\+b\\"c\\\\d\\<e\\>f\\;g # é'),
    (x509.Name([x509.RelativeDistinguishedName([A(NameOID.COMMON_NAME, "node-b"),
                                                A(NameOID.ORGANIZATION_NAME, "o")])]), "O=o+CN=node-b"),
    (x509.Name([A(NameOID.DOMAIN_COMPONENT, "local"), A(NameOID.LOCALITY_NAME, "Paris"),
                A(NameOID.STATE_OR_PROVINCE_NAME, "IdF"), A(NameOID.USER_ID, "u1"), A(NameOID.COMMON_NAME, "n")]),
     "DC=local,L=Paris,ST=IdF,UID=u1,CN=n"),
])
def test_a_subject_is_written_as_gnutls_writes_it(tmp_path: Path, subject: x509.Name, written: str) -> None:
    files = mint(tmp_path).cluster.issue("x", server=False, subject=subject)
    assert x509_name.pem_subject(files.cert.read_bytes()) == written


def test_a_name_inside_another_attribute_stays_escaped(tmp_path: Path) -> None:
    assert x509_name.pem_subject(crafted_intruder(mint(tmp_path)).cert.read_bytes()) == "CN=intruder,OU=x\\,CN=node-b"


@pytest.mark.parametrize("value", ["#node-b", " node-b", "node-b ", "node\x01b"])
def test_a_value_libraries_write_differently_is_refused_not_guessed(tmp_path: Path, value: str) -> None:
    files = mint(tmp_path).cluster.issue("x", server=False, subject=x509.Name([A(NameOID.COMMON_NAME, value)]))
    with pytest.raises(ValueError, match="CN="):
        x509_name.pem_subject(files.cert.read_bytes())


def test_not_a_certificate_is_a_value_error() -> None:
    for pem in (b"", b"-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n"):
        with pytest.raises(ValueError):
            x509_name.pem_subject(pem)
