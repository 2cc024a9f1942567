"""A certificate's subject written exactly as QEMU (GnuTLS) writes it for its TLS authorization objects.

qemu-nbd's `--tls-authz` compares an identity string with the client
certificate's distinguished name as GnuTLS renders it
(`gnutls_x509_crt_get_dn`): the certificate's own order, `,` between
RDNs, `+` inside a multi-valued one, the values `,+"\\<>;` escaped with a
backslash, UTF-8 as is, and an attribute GnuTLS has no name for as its
dotted OID and `#` with the hex of its DER value. Measured on qemu-nbd
10.0.13: `CN=intruder,OU=x\\,CN=node-b`,
`C=US,O=SPIRE,CN=node-b,2.5.4.45=#0c0a...`, `O=o+CN=node-b`.

So the copy server can allow one exact string (QEMU's `authz-simple`), the
subject of the very certificate the lease's node presented, and a glob on
a part of it is never needed. Only what was measured or is plain is
rendered; anything else (a value with a leading `#` or space, an unusual
string type for a named attribute) raises ValueError, so a subject is never
guessed. Pure: no I/O, no third-party parser.
"""

from __future__ import annotations

import base64
import re

# The attributes GnuTLS names, by OID; every other one is written as OID=#hex.
NAMES = {
    "2.5.4.3": "CN", "2.5.4.6": "C", "2.5.4.7": "L", "2.5.4.8": "ST", "2.5.4.10": "O", "2.5.4.11": "OU",
    "0.9.2342.19200300.100.1.25": "DC", "0.9.2342.19200300.100.1.1": "UID",
}
_TEXT_TAGS = {0x0C: "utf-8", 0x13: "ascii", 0x16: "ascii"}  # UTF8String, PrintableString, IA5String
_SEQUENCE, _SET, _OID = 0x30, 0x31, 0x06
_ESCAPED = re.compile(r'([,+"\\<>;])')
_PEM_RE = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.S)


def _tlv(data: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start of the value, end of the value) of the DER element at `at`. Raises ValueError."""
    if at + 2 > len(data):
        raise ValueError("truncated DER")
    tag, length = data[at], data[at + 1]
    at += 2
    if length & 0x80:
        count = length & 0x7F
        if not 0 < count <= 4 or at + count > len(data):
            raise ValueError("bad DER length")
        length = int.from_bytes(data[at:at + count], "big")
        at += count
    if at + length > len(data):
        raise ValueError("truncated DER")
    return tag, at, at + length


def _children(data: bytes, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(tag, value start, value end, element start) of each element between `start` and `end`."""
    found, at = [], start
    while at < end:
        tag, value, after = _tlv(data, at)
        found.append((tag, value, after, at))
        at = after
    return found


def _oid(raw: bytes) -> str:
    if not raw:
        raise ValueError("empty OID")
    parts, value = [], 0
    for byte in raw[1:]:
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            parts.append(value)
            value = 0
    first = raw[0]
    head = [min(first // 40, 2), first - 40 * min(first // 40, 2)]
    return ".".join(map(str, head + parts))


def _value(oid: str, data: bytes, tag: int, start: int, end: int, element: int) -> str:
    name = NAMES.get(oid)
    if name is None:
        return f"{oid}=#{data[element:end].hex()}"
    encoding = _TEXT_TAGS.get(tag)
    if encoding is None:
        raise ValueError(f"{name} is not a plain string (DER tag {tag:#x})")
    text = data[start:end].decode(encoding)
    if not text or text[0] in "# " or text[-1] == " " or any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise ValueError(f"{name}={text!r} is not written the same by every TLS library")
    return name + "=" + _ESCAPED.sub(r"\\\1", text)


def subject(der: bytes) -> str:
    """The subject of the DER certificate `der`, as GnuTLS writes it. Raises ValueError."""
    _, start, end = _tlv(der, 0)  # Certificate
    top = _children(der, start, end)
    if not top or top[0][0] != _SEQUENCE:
        raise ValueError("not a certificate")
    start, end = top[0][1], top[0][2]  # tbsCertificate
    fields = _children(der, start, end)
    if fields and fields[0][0] == 0xA0:  # [0] version
        fields = fields[1:]
    if len(fields) < 5 or fields[4][0] != _SEQUENCE:  # serial, signature, issuer, validity, subject
        raise ValueError("not a certificate")
    rdns = []
    for tag, start, end, _ in _children(der, fields[4][1], fields[4][2]):
        if tag != _SET:
            raise ValueError("bad distinguished name")
        parts = []
        for tag, inner, inner_end, _ in _children(der, start, end):
            atv = _children(der, inner, inner_end)
            if tag != _SEQUENCE or len(atv) != 2 or atv[0][0] != _OID:
                raise ValueError("bad attribute in the distinguished name")
            oid = _oid(der[atv[0][1]:atv[0][2]])
            parts.append(_value(oid, der, *atv[1]))
        rdns.append("+".join(parts))
    if not rdns:
        raise ValueError("the certificate has an empty subject")
    return ",".join(rdns)


def pem_subject(pem: bytes) -> str:
    """`subject` of the first certificate in PEM text. Raises ValueError."""
    found = _PEM_RE.search(pem)
    if found is None:
        raise ValueError("no PEM certificate")
    return subject(base64.b64decode(b"".join(found.group(1).split()), validate=True))
