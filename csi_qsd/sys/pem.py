"""The PEM files of a TLS identity, as configuration: paths to check, read and watch, nothing of gRPC.

Config names them; only `csi_qsd.transport.tls`, which builds gRPC credentials from
them, needs gRPC.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class PemFiles:
    """A certificate, its private key, and the CA that peers' certificates must chain to."""

    cert: Path
    key: Path
    ca: Path

    def missing(self) -> list[Path]:
        return [path for path in (self.cert, self.key, self.ca) if not path.is_file()]

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA bundle); raises OSError when one cannot be read."""
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()

    def stamp(self) -> tuple[int, ...]:
        """Modification times (ns) of the three files, resolved: changes when kubelet swaps a Secret's files."""
        return tuple(path.stat().st_mtime_ns for path in (self.cert, self.key, self.ca))
