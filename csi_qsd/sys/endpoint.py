"""A CSI endpoint's UNIX socket path, from its `unix://` URL: configuration, with nothing of gRPC.

Config (and everything that reads it, the QSD supervisor included) needs
the path; only the server that listens there needs gRPC.
"""

from __future__ import annotations

from pathlib import Path

PREFIX = "unix://"


def socket_path(endpoint: str) -> Path:
    """The UNIX socket path of `endpoint` (only unix:// endpoints are served). Raises ValueError."""
    if not endpoint.startswith(PREFIX):
        raise ValueError(f"endpoint {endpoint!r} must start with unix://")
    return Path(endpoint[len(PREFIX):])
