"""qemu-nbd serving one read-only image over TCP with mutual TLS, detached: it outlives the driver.

The source end of a copy across nodes (`csi_qsd.controller.copy_targets`). Like
QSD, the server is part of the data plane: a driver that restarts finds it
by its pid file and leaves it serving, so a copy reading through it never
notices. One that is gone (the node rebooted, or it was killed) is started
again on the same port, which the copy's NBD client keeps reconnecting to.

TLS: QEMU's `tls-creds-x509` reads fixed file names from one directory
(`ca-cert.pem`, `server-cert.pem`, `server-key.pem` for a server,
`client-*.pem` for a client); `credentials` lays the node's PEM files out
that way in a directory of the runtime directory (`csi_qsd.sys.runtime`:
tmpfs, private to root) only while QEMU loads them. Both ends verify the peer against the CA, and the
server lets in only the one node its lease is for: an `authz-simple` object
(`--tls-authz`) whose identity is the whole distinguished name of the
certificate that node presented when it asked for the lease, written as
QEMU (GnuTLS) writes it (`csi_qsd.sys.x509_name`), compared as one exact
string. No glob: a certificate of the same CA whose other attributes
merely contain the node's name (`CN=intruder,OU=x\\,CN=node-b`) is another
string. Measured on qemu-nbd 10.0.13: any other certificate of the same
CA is refused during option negotiation ("TLS x509 authz check for
CN=node-c is denied"), before any export is listed. The key is never
logged, nor passed on a command line.

A server is known by its pid file and port on its command line, not by
argv[0]: run through its own loader (`ld.so --argv0`, `csi_qsd.sys.tools`),
qemu-nbd's /proc command line starts with the loader's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from csi_qsd.sys import durable, runtime
from csi_qsd.sys.run import run

START_SECONDS = 30.0
# The fixed newstyle greeting every NBD server sends first, before any TLS (NBDMAGIC, IHAVEOPT).
NBD_GREETING = b"NBDMAGIC" + b"IHAVEOPT"
NBD_OPT_ABORT = 2
STOP_SECONDS = 10.0
TLS_OBJECT_ID = "cqtls0"
AUTHZ_OBJECT_ID = "cqauthz0"


def authz_object(subject: str) -> str:
    """qemu-nbd's `--object` (JSON) admitting only a client certificate whose distinguished name, as QEMU writes
    it, is exactly `subject` (`csi_qsd.sys.x509_name.subject`)."""
    return json.dumps({"qom-type": "authz-simple", "id": AUTHZ_OBJECT_ID, "identity": subject},
                      separators=(",", ":"))


def plain_subject(node: str) -> str:
    """The subject of a plain node certificate, `CN=<node>`: a node name needs no escaping."""
    return f"CN={node}"


def tls_dir(directory: Path, cert: Path, key: Path, ca: Path, *, endpoint: str) -> Path:
    """Lay out `cert`, `key` and `ca` as QEMU's x509 credentials for `endpoint` ('server' or 'client').

    Rewritten only when the bytes differ (atomically, mode 0600). Raises OSError.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for source, name in ((ca, "ca-cert.pem"), (cert, f"{endpoint}-cert.pem"), (key, f"{endpoint}-key.pem")):
        data = source.read_bytes()
        target = directory / name
        with contextlib.suppress(FileNotFoundError):
            if target.read_bytes() == data:
                continue
        durable.create(target, lambda fd: os.write(fd, data))
    durable.fsync_path(directory)
    return directory


@contextlib.asynccontextmanager
async def credentials(runtime_dir: Path, cert: Path, key: Path, ca: Path, *, endpoint: str) -> AsyncIterator[Path]:
    """`cert`, `key` and `ca` laid out for QEMU (`tls_dir`) in a new private directory of `runtime_dir`, for the
    block that has QEMU load them; the directory and every file in it are gone when the block ends.

    Raises OSError (FileNotFoundError naming a missing file).
    """
    directory = await asyncio.to_thread(runtime.new_scratch, runtime_dir)
    try:
        await asyncio.to_thread(tls_dir, directory, cert, key, ca, endpoint=endpoint)
        yield directory
    finally:  # in a thread that ends its work even when the caller is cancelled
        await asyncio.to_thread(runtime.remove, directory)


def port_free(host: str, port: int) -> bool:
    """True if nothing listens on host:port now (a bind succeeds)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(host: str, ports: range, taken: set[int]) -> int | None:
    """The first port of `ports` not in `taken` that nothing listens on; None when every one is in use."""
    for port in ports:
        if port not in taken and port_free(host, port):
            return port
    return None


def serving_pid(pid_file: Path, port: int) -> int | None:
    """The pid of the qemu-nbd that `pid_file` names if it still runs and serves `port`, else None.

    Known by its command line: started with this pid file and this port. Not by argv[0]: a qemu-nbd run
    through its own loader (`csi_qsd.sys.tools`, `ld.so --argv0`) shows the loader's command line there.
    """
    try:
        pid = int(pid_file.read_text().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if (not any(arg.endswith(b"qemu-nbd") for arg in argv) or str(pid_file).encode() not in argv
            or str(port).encode() not in argv):
        return None
    return pid


def started_before(pid: int, files: Iterable[Path]) -> bool:
    """True if process `pid` started before the newest of `files` was written (a renewed certificate that a
    running server has not read); False if either cannot be told."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])  # btime is whole seconds only
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks
        newest = max(path.stat().st_mtime for path in files)  # through links: a Secret's files are links
    except (OSError, ValueError, IndexError):
        return False
    return started < newest


def admits_only(pid: int, subject: str) -> bool:
    """True if the qemu-nbd at `pid` was started to let in the certificate `subject` alone (`start`'s `admit`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return authz_object(subject).encode() in argv and b"--tls-authz" in argv


async def start(
    qemu_nbd: str, image_spec: str, *, host: str, port: int, export: str, tls: Path, pid_file: Path, admit: str,
) -> int:
    """Start qemu-nbd serving `image_spec` read-only as `export` on host:port, TLS from `tls`; its pid.

    Only a client whose certificate's subject is exactly `admit` gets past the TLS handshake's authorization.
    `--fork` returns once it listens; it runs in a session of its own, so the
    driver's end does not end it. Raises HostCommandError if it cannot start.
    """
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.unlink(missing_ok=True)
    await run(
        "setsid", qemu_nbd, "--fork", "--pid-file", str(pid_file), "--bind", host, "--port", str(port),
        "--export-name", export, "--read-only", "--shared=4", "--persistent",
        "--object", f"tls-creds-x509,id={TLS_OBJECT_ID},dir={tls},endpoint=server,verify-peer=on",
        "--object", authz_object(admit), "--tls-creds", TLS_OBJECT_ID, "--tls-authz", AUTHZ_OBJECT_ID, image_spec,
        timeout=START_SECONDS,
    )
    return int(pid_file.read_text().strip())


async def stop(pid_file: Path, port: int) -> None:
    """Stop the server `pid_file` names (SIGTERM, a bounded wait, SIGKILL); nothing if it is not running."""
    pid = serving_pid(pid_file, port)
    if pid is not None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + STOP_SECONDS
            while serving_pid(pid_file, port) == pid and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if serving_pid(pid_file, port) != pid:
                break
    pid_file.unlink(missing_ok=True)


async def answers(address: str, timeout: float) -> bool:
    """True if an NBD server at host:port greets within `timeout` seconds (then told goodbye and closed).

    Stronger than a connect: a port that something else holds, or a server
    too wedged to speak, accepts connections but never greets. QEMU's NBD
    client would wait on either for its whole open-timeout, with QSD's
    monitor silent, so the driver asks this first.
    """
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
        greeting = await asyncio.wait_for(reader.readexactly(len(NBD_GREETING) + 2),
                                          max(0.0, deadline - loop.time()))
        if greeting[:len(NBD_GREETING)] != NBD_GREETING:
            return False
        # Client flags (fixed newstyle, no zeroes), then NBD_OPT_ABORT: the server ends the session cleanly.
        writer.write(struct.pack(">I", 3) + b"IHAVEOPT" + struct.pack(">II", NBD_OPT_ABORT, 0))
        return True
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), timeout)
