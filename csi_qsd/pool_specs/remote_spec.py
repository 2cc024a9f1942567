"""The spelling of a remote pool: `--remote-pool NAME=URL[,secret=DIR][,tls=DIR[,tls-name=NAME]|,insecure][,on-error=wait|fail][,force]`.

A remote pool is a device pool whose device is a target QEMU's own block
drivers reach over the network (`csi_qsd.pools.remote`): an iSCSI LUN (libiscsi in
QSD) or an NBD export. Apart from the pool so the configuration can
validate it without importing the pool. Strict on purpose: what is parsed
here becomes QSD's `blockdev-add` arguments.

URLs, as QEMU spells them:

* `iscsi://HOST[:PORT]/IQN/LUN` (port 3260);
* `nbd://HOST[:PORT]/EXPORT` (port 10809) and `nbd+unix:///EXPORT?socket=PATH`.

Credentials never appear in a URL (a `user:password@` part is refused, so
no flag, environment variable or log line can carry them): `secret=DIR`
names a directory (a mounted Kubernetes Secret) holding `username` and
`password` for iSCSI CHAP; `tls=DIR` names QEMU's x509 directory for NBD
(`ca-cert.pem`, `client-cert.pem`, `client-key.pem`); the server's
certificate must name the URL's host, or `tls-name` (required over a UNIX
socket, which has no host name to check).

NBD over TCP without `tls=` would carry every volume of the pool in clear
text to anyone who reaches the port, and let anyone who can answer on it
pose as the target: it is refused unless the flag says so on purpose
(`,insecure`). iSCSI has no TLS in QEMU; a pool without CHAP is accepted
but warned about when it opens (`csi_qsd.pools.remote`).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import re
import urllib.parse
from pathlib import Path

from csi_qsd.pool_specs.kind import PoolKind

ISCSI_PORT = 3260
NBD_PORT = 10809
IQN_RE = re.compile(r"^(iqn\.\d{4}-\d{2}\.[a-z0-9.-]+(:[^\s/]+)?|eui\.[0-9A-Fa-f]{16}|naa\.[0-9A-Fa-f]{16,32})\Z")
HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})\Z")
EXPORT_RE = re.compile(r"^[A-Za-z0-9._-]{1,255}\Z")
MAX_LUN = 16383


class Scheme(enum.Enum):
    ISCSI = "iscsi"
    NBD = "nbd"
    NBD_UNIX = "nbd+unix"


class OnError(enum.Enum):
    """What I/O does while the target is away: wait for it to come back, or fail after a bound."""

    WAIT = "wait"
    FAIL = "fail"


@dataclasses.dataclass(frozen=True)
class RemoteTarget:
    """Where the remote device is: an iSCSI LUN, or an NBD export over TCP or a UNIX socket."""

    scheme: Scheme
    host: str = ""
    port: int = 0
    socket: Path | None = None
    iqn: str = ""
    lun: int = 0
    export: str = ""

    @classmethod
    def parse(cls, text: str) -> "RemoteTarget":
        """Parse an iscsi://, nbd:// or nbd+unix:// URL; raises ValueError naming what is wrong."""
        scheme_text, sep, _ = text.partition("://")
        try:
            scheme = Scheme(scheme_text)
        except ValueError:
            known = ", ".join(f"{s.value}://" for s in Scheme)
            raise ValueError(f"{text!r}: unknown scheme {scheme_text + sep!r} (known: {known})") from None
        url = urllib.parse.urlsplit(text)
        if url.username is not None or url.password is not None:
            raise ValueError(f"{urllib.parse.urlunsplit(url._replace(netloc='…'))!r}: credentials do not go in "
                             "the URL; give them in the pool's secret directory (secret=DIR)")
        if url.fragment:
            raise ValueError(f"{text!r}: a URL fragment means nothing here")
        if scheme is Scheme.NBD_UNIX:
            return cls._unix(text, url)
        host, port = cls._endpoint(text, url, ISCSI_PORT if scheme is Scheme.ISCSI else NBD_PORT)
        if url.query:
            raise ValueError(f"{text!r}: no query options for {scheme.value}://")
        if scheme is Scheme.NBD:
            return cls(scheme, host, port, export=cls._export(text, url.path))
        parts = url.path.split("/")
        if len(parts) != 3 or parts[0]:
            raise ValueError(f"{text!r}: expected iscsi://HOST[:PORT]/IQN/LUN")
        iqn, lun = parts[1], parts[2]
        if not IQN_RE.match(iqn):
            raise ValueError(f"{text!r}: {iqn!r} is not an iSCSI qualified name (iqn.YYYY-MM.domain[:name])")
        if not lun.isdigit() or int(lun) > MAX_LUN:
            raise ValueError(f"{text!r}: LUN must be a number from 0 to {MAX_LUN}")
        return cls(scheme, host, port, iqn=iqn, lun=int(lun))

    @staticmethod
    def _endpoint(text: str, url: urllib.parse.SplitResult, default_port: int) -> tuple[str, int]:
        try:
            host, port = url.hostname or "", url.port or default_port
        except ValueError:
            raise ValueError(f"{text!r}: the port must be a number from 1 to 65535") from None
        if not host:
            raise ValueError(f"{text!r}: no host")
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            if not HOST_RE.match(host):
                raise ValueError(f"{text!r}: {host!r} is not a host name or IP address") from None
        return host, port

    @staticmethod
    def _export(text: str, path: str) -> str:
        name = path[1:] if path.startswith("/") else path
        if not EXPORT_RE.match(name):
            raise ValueError(f"{text!r}: expected an export name ([A-Za-z0-9._-]) after the host")
        return name

    @classmethod
    def _unix(cls, text: str, url: urllib.parse.SplitResult) -> "RemoteTarget":
        if url.netloc:
            raise ValueError(f"{text!r}: nbd+unix:// takes no host (nbd+unix:///EXPORT?socket=PATH)")
        query = urllib.parse.parse_qs(url.query, strict_parsing=bool(url.query))
        sockets = query.pop("socket", [])
        if query or len(sockets) != 1 or not sockets[0].startswith("/"):
            raise ValueError(f"{text!r}: expected nbd+unix:///EXPORT?socket=/ABSOLUTE/PATH")
        return cls(Scheme.NBD_UNIX, socket=Path(sockets[0]), export=cls._export(text, url.path))

    def __str__(self) -> str:
        if self.scheme is Scheme.ISCSI:
            return f"iscsi://{self._netloc()}/{self.iqn}/{self.lun}"
        if self.scheme is Scheme.NBD:
            return f"nbd://{self._netloc()}/{self.export}"
        return f"nbd+unix:///{self.export}?socket={self.socket}"

    def _netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class RemotePoolSpec:
    """One `--remote-pool`: a target carved into raw extents like a device pool."""

    name: str
    target: RemoteTarget
    secret: Path | None = None
    tls: Path | None = None
    on_error: OnError = OnError.WAIT
    force: bool = False
    tls_name: str = ""
    insecure: bool = False

    @classmethod
    def parse(cls, text: str, pool_name_re: re.Pattern[str], reserved: str) -> "RemotePoolSpec":
        """Parse NAME=URL[,secret=DIR][,tls=DIR[,tls-name=NAME]|,insecure][,on-error=wait|fail][,force].

        Raises ValueError naming the flag.
        """
        name, eq, rest = text.partition("=")
        flag = f"--remote-pool {name}" if eq else "--remote-pool"
        url, *options = rest.split(",")
        if not eq or not url:
            raise ValueError(f"{flag}: expected NAME=URL[,secret=DIR][,tls=DIR][,on-error=wait|fail][,force]")
        if not pool_name_re.match(name) or name == reserved:
            raise ValueError(f"{flag}: pool name must match {pool_name_re.pattern} and not be {reserved!r}")
        try:
            target = RemoteTarget.parse(url)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        found: dict[str, str] = {}
        for option in options:
            key, has_value, value = option.partition("=")
            if (key not in ("secret", "tls", "tls-name", "on-error", "force", "insecure") or key in found
                    or (key in ("force", "insecure")) == bool(has_value)):
                raise ValueError(f"{flag}: bad option {option!r} (secret=DIR, tls=DIR, tls-name=NAME, "
                                 "insecure, on-error=wait|fail, force; each once)")
            found[key] = value
        for key in ("secret", "tls"):
            if key in found and not found[key].startswith("/"):
                raise ValueError(f"{flag}: {key}= must be an absolute directory")
        if "tls" in found and target.scheme is Scheme.ISCSI:
            raise ValueError(f"{flag}: tls= is for NBD targets (QEMU's iSCSI driver has no TLS)")
        if "tls-name" in found and ("tls" not in found or not HOST_RE.match(found["tls-name"])):
            raise ValueError(f"{flag}: tls-name= is a host name, and needs tls=")
        if "tls" in found and "tls-name" not in found and target.scheme is Scheme.NBD_UNIX:
            raise ValueError(f"{flag}: over a UNIX socket, TLS needs tls-name=NAME: the name the server's "
                             "certificate carries")
        if "secret" in found and target.scheme is not Scheme.ISCSI:
            raise ValueError(f"{flag}: secret= is for iSCSI CHAP; NBD authenticates with tls= certificates")
        try:
            on_error = OnError(found.get("on-error", OnError.WAIT.value))
        except ValueError:
            raise ValueError(f"{flag}: on-error must be 'wait' or 'fail'") from None
        if target.scheme is Scheme.NBD and "tls" not in found and "insecure" not in found:
            raise ValueError(f"{flag}: NBD over TCP needs tls=DIR (QEMU's x509 client directory): without it "
                             "every volume of the pool crosses the network in clear text and any host that "
                             "answers on that address can pose as the target; add ',insecure' to accept that")
        if "insecure" in found and ("tls" in found or target.scheme is not Scheme.NBD):
            raise ValueError(f"{flag}: insecure is for NBD over TCP without tls=, and nothing else")
        return cls(name, target, Path(found["secret"]) if "secret" in found else None,
                   Path(found["tls"]) if "tls" in found else None, on_error, "force" in found,
                   found.get("tls-name", ""), "insecure" in found)

    @property
    def flag(self) -> str:
        return f"--remote-pool {self.name}"

    @property
    def kind(self) -> PoolKind:
        """Which pool opens it (`csi_qsd.pools.pool_kinds`)."""
        return PoolKind.REMOTE
