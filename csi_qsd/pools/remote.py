"""Remote pools: an iSCSI LUN or an NBD export, reached by QEMU's own drivers in QSD, carved like a device pool.

`--remote-pool NAME=URL[,secret=DIR][,tls=DIR|,insecure][,on-error=wait|fail][,force]`
(`csi_qsd.pool_specs.remote_spec`). csi-qsd's volumes (raw extents with QoS, FUSE, vhost-user-blk)
in front of a SAN or NAS target that has none of that: libiscsi (with CHAP)
or QEMU's NBD client (with x509 TLS) inside QSD; the host needs no
initiator, no kernel module, no block device. Everything that touches
the device goes through QSD (`DevicePoolThroughQSD`): label, probe, scrubs.

What must never happen, and how it is prevented:

* **A credential leaks.** It never appears in a URL (refused at parse), a
  flag or a log: the CHAP password reaches QSD as a `secret` object that
  names the file, so it is not even on the QMP wire; only the user name is
  read here.
* **A target that goes away wedges the node's QSD.** At start-up, and in
  every volume check, the target is only connected to (TCP or UNIX socket;
  an NBD server's greeting read) within `REACH_TIMEOUT`, never logged into
  or read from, so a check cannot hang; QSD is asked to open a target only once it answered that way (QEMU's
  iSCSI login runs in QSD's main loop and would stall its monitor for a
  black-holed address). While the target is away, I/O waits for it
  (`on-error=wait`) or fails after `FAIL_AFTER_SECONDS` (`on-error=fail`),
  and its volumes report abnormal.
* **Data crosses the network unprotected without anyone deciding so.** NBD
  over TCP needs `tls=` unless the flag says `insecure` (`csi_qsd.pool_specs.remote_spec`);
  an iSCSI pool without CHAP (`secret=`), which QEMU cannot encrypt either,
  is logged as a warning each time it opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from csi_qsd.errors import StartupError
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pool_specs.remote_spec import RemotePoolSpec, Scheme
from csi_qsd.pools.device import DevicePool
from csi_qsd.pools.through_qsd import DevicePoolThroughQSD
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.storage import RemoteDevice
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints

if TYPE_CHECKING:
    from csi_qsd.catalog import Catalog

log = logging.getLogger(__name__)

REACH_TIMEOUT = 2.0
# The NBD handshake (newstyle, fixed): the server's greeting, and the client's goodbye before any option.
NBD_GREETING = b"NBDMAGIC" + b"IHAVEOPT"
NBD_FLAG_C_FIXED_NEWSTYLE = 1
NBD_OPT_ABORT = 2


async def nbd_greets(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """True if the peer greets as an NBD server (then told goodbye). Raises IncompleteReadError, OSError."""
    greeting = await reader.readexactly(len(NBD_GREETING) + 2)  # + the server's 16-bit handshake flags
    if not greeting.startswith(NBD_GREETING):
        return False
    writer.write(struct.pack(">I", NBD_FLAG_C_FIXED_NEWSTYLE) + b"IHAVEOPT" + struct.pack(">II", NBD_OPT_ABORT, 0))
    await writer.drain()
    return True


def read_credentials(spec: RemotePoolSpec) -> tuple[str, Path | None]:
    """The CHAP user name and the password's file, from the pool's secret directory. Raises StartupError."""
    if spec.secret is None:
        if spec.target.scheme is Scheme.ISCSI:
            log.warning("event=remote_pool_unauthenticated pool=%s target=%s hint=%s", spec.name, spec.target,
                        "no CHAP (secret=DIR): any host on the network that reaches the target can log in to this "
                        "LUN, and any host that answers on its address can pose as it; give the pool a CHAP "
                        "secret and keep the storage network private")
        return "", None
    user_file, password_file = spec.secret / "username", spec.secret / "password"
    try:
        user = user_file.read_text()
        password = password_file.read_bytes()
    except OSError as exc:
        raise StartupError(f"{spec.flag}: cannot read the CHAP credentials in {spec.secret} "
                           f"(files 'username' and 'password'): {exc.strerror}: {exc.filename}") from None
    if not user.strip() or not password:
        raise StartupError(f"{spec.flag}: {spec.secret} holds an empty user name or password")
    if password.endswith(b"\n"):
        raise StartupError(f"{spec.flag}: {password_file} ends with a newline, which would be part of the "
                           "password (create the Secret from a literal or with echo -n)")
    return user.strip(), password_file


class RemotePool(DevicePoolThroughQSD):
    """A device pool on a remote target; each volume's window opens its own session or connection."""

    def __init__(self, spec: RemotePoolSpec, catalog: Catalog, view_dir: Path,
                 failpoints: Failpoints = NO_FAILPOINTS) -> None:
        user, password_file = read_credentials(spec)
        tls = spec.tls
        if tls is not None and not (tls / "ca-cert.pem").is_file():
            raise StartupError(f"{spec.flag}: {tls} has no ca-cert.pem (QEMU's x509 directory: ca-cert.pem, "
                               "client-cert.pem, client-key.pem)")
        base = RemoteDevice(spec.target, f"r-{spec.name}", spec.on_error, user, password_file, tls, spec.tls_name)
        # The device pool's spec names the pool and `force`; the path is unused (nothing on the host).
        super().__init__(DevicePoolSpec(spec.name, Path(os.devnull), spec.force), catalog, view_dir, base, failpoints)
        self.remote = spec
        self.remote_device = base

    async def _add_base(self, client: QSDClient) -> None:
        present = {str(item["name"]) for item in await client.execute("qom-list", {"path": "/objects"})}
        for obj in self.remote_device.objects():
            if obj["id"] not in present:
                await client.execute("object-add", obj)
        await super()._add_base(client)

    def configured_as(self) -> str:
        return f"--remote-pool {self.id}={self.remote.target}"

    def startup_name(self) -> str:
        return f"{self.remote.flag} ({self.remote.target})"

    def describe(self) -> str:
        return str(self.remote.target)

    async def problem(self) -> str:
        """Whether the target answers within REACH_TIMEOUT: no login, no I/O on the device, bounded.

        iSCSI: it accepts a connection. NBD: its server also sends its
        greeting, and is told goodbye (NBD_OPT_ABORT): a listening socket
        alone proves nothing, as one outlived a SIGKILLed QSD 11.1.3 (its
        io_uring held it) and took connections nobody would serve.
        """
        target = self.remote.target
        try:
            async with asyncio.timeout(REACH_TIMEOUT):
                if target.scheme is Scheme.NBD_UNIX:
                    reader, writer = await asyncio.open_unix_connection(str(target.socket))
                else:
                    reader, writer = await asyncio.open_connection(target.host, target.port)
                try:
                    if target.scheme is not Scheme.ISCSI and not await nbd_greets(reader, writer):
                        return f"target {target} of pool {self.id} does not answer as an NBD server"
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
        except TimeoutError:
            return f"target {target} of pool {self.id} does not answer (nothing within {REACH_TIMEOUT:g}s)"
        except OSError as exc:
            return f"target {target} of pool {self.id} is unreachable: {exc.strerror or exc}"
        except asyncio.IncompleteReadError:
            return f"target {target} of pool {self.id} is unreachable: it closed the connection"
        return ""

    def device_problem(self) -> str:
        raise NotImplementedError("a remote pool's problem is asked asynchronously (problem())")

    def same_device(self, other: DevicePool) -> bool:
        return isinstance(other, RemotePool) and other.remote.target == self.remote.target
