"""The values of the upstream sidecars' flags, spelled as Go's `flag` package and klog spell them.

The manifests give `csi-qsd kubelet-registrar` and `csi-qsd liveness-probe`
the command lines written for node-driver-registrar and livenessprobe, so
their values parse as those programs parse them: durations in Go's syntax
(`3s`, `1m30s`), listen addresses as `host:port` or `:port`, the CSI socket
as a path or a `unix://` URL, and klog's `--v=N` verbosity. Every parser
raises ValueError with the text it could not read.
"""

from __future__ import annotations

import re
from pathlib import Path

from csi_qsd.sys import text_http
from csi_qsd.sys.endpoint import PREFIX as UNIX_PREFIX

# Go's time.ParseDuration units, in seconds (both spellings of micro).
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TERM = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
# klog's verbosity from which csi-qsd logs at debug: 4 is where Kubernetes components start debug output.
DEBUG_VERBOSITY = 4


def duration(text: str) -> float:
    """Seconds of a Go duration: `3s`, `1.5m`, `1m30s`, `250ms`, `0`; an optional sign. Raises ValueError."""
    sign, body = (text[0], text[1:]) if text[:1] in ("+", "-") else ("", text)
    if body == "0":
        return 0.0
    position, seconds = 0, 0.0
    while position < len(body):
        term = _TERM.match(body, position)
        if term is None:
            break
        seconds += float(term.group(1)) * _UNITS[term.group(2)]
        position = term.end()
    if not body or position != len(body):
        raise ValueError(f"expected a duration such as 3s, 1m30s or 500ms, got {text!r}")
    return -seconds if sign == "-" else seconds


def timeout(text: str) -> float:
    """A Go duration that must be positive, in seconds. Raises ValueError."""
    seconds = duration(text)
    if not seconds > 0:
        raise ValueError(f"expected a positive duration such as 3s, got {text!r}")
    return seconds


def csi_endpoint(text: str) -> str:
    """The `unix://` endpoint of the CSI socket given as a path or a `unix://` (or `unix:`) URL. Raises ValueError."""
    if text.startswith(UNIX_PREFIX):
        path = text[len(UNIX_PREFIX):]
    elif text.startswith("unix:"):
        path = text[len("unix:"):]
    elif "://" in text:
        raise ValueError(f"the CSI socket is a path or a unix:// URL, got {text!r}")
    else:
        path = text
    if not path:
        raise ValueError(f"expected the CSI socket's path, got {text!r}")
    return UNIX_PREFIX + str(Path(path).absolute())


def http_endpoint(text: str) -> str:
    """A listen address, `host:port`, `[v6]:port` or `:port` (all interfaces), as given; "" for none.

    Raises ValueError.
    """
    if text:
        text_http.listen_address(text)
    return text


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: no server). Raises ValueError."""
    if not (text.isascii() and text.isdigit() and int(text) <= 65535):
        raise ValueError(f"expected a TCP port 0..65535, got {text!r}")
    return int(text)


def health_address(http_endpoint: str, health_port: int | None, default_port: int = 0) -> str:
    """Where /healthz listens: --http-endpoint, else `:PORT` of --health-port (or its default); "" for no server.

    Raises ValueError when both are given, as the upstream sidecars refuse them.
    """
    if http_endpoint and health_port is not None:
        raise ValueError("only one of --health-port and --http-endpoint can be set")
    if http_endpoint:
        return http_endpoint
    chosen = default_port if health_port is None else health_port
    return f":{chosen}" if chosen else ""


def verbosity(text: str) -> int:
    """klog's `--v=N`: any whole number, as klog reads it. Raises ValueError."""
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError(f"expected a whole number, got {text!r}")
    return int(text)


def log_level(verbosity: int) -> str:
    """The log level for klog's `--v=N`: debug from DEBUG_VERBOSITY up, info below (any N is accepted)."""
    return "debug" if verbosity >= DEBUG_VERBOSITY else "info"
