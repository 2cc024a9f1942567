"""Remote targets for the remote pools' tests, real and on this machine: `tgtd` (iSCSI) and a second QSD (NBD).

Each runs as a child process on 127.0.0.1 (or a UNIX socket) with its own
ports, serving a sparse file the test reads back directly; each can go
away (SIGKILL) and come back on the same address with the same bytes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from pathlib import Path

from csi_qsd.sys.tools import bundled
from testing.certs import Authority
from testing.harness import free_port, terminate, until

IQN = "iqn.2026-01.io.csi-qsd:pool"
CHAP_USER = "csi-qsd-node"
CHAP_PASSWORD = "not-in-any-log-7f3a"


def sparse_file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def read_at(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


class TargetProcess:
    """A target served by a child process, which can go away at once and be stopped."""

    proc: asyncio.subprocess.Process | None = None

    async def kill(self) -> None:
        """The target goes away at once, as a crashed or unplugged array does."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        await terminate(self.proc)


class Tgt(TargetProcess):
    """`tgtd` serving one file as LUN 1 of one target, CHAP required, on 127.0.0.1:`port`."""

    def __init__(self, root: Path, size: int) -> None:
        self.lun = sparse_file(root / "lun.img", size)
        self.port = free_port()
        self.control = 1000 + self.port % 30000  # tgtd's control socket number: one per instance
        self.log = root / "tgtd.log"
        self.secret = root / "chap"
        self.secret.mkdir(mode=0o700)
        (self.secret / "username").write_text(CHAP_USER)
        (self.secret / "password").write_text(CHAP_PASSWORD)

    @property
    def url(self) -> str:
        return f"iscsi://127.0.0.1:{self.port}/{IQN}/1"

    def _admin(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tgtadm", "-C", str(self.control), "--lld", "iscsi", *args],
                              capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})

    async def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                shutil.which("tgtd") or "/usr/sbin/tgtd", "-f", "-C", str(self.control),
                "--iscsi", f"portal=127.0.0.1:{self.port}", stdout=log, stderr=log, start_new_session=True)
        await until(lambda: self._admin("--mode", "target", "--op", "show").returncode == 0,
                    lambda: f"tgtd's control socket; its log:\n{self.log.read_text()}", 20)
        for args in (("--op", "new", "--mode", "target", "--tid", "1", "-T", IQN),
                     ("--op", "new", "--mode", "logicalunit", "--tid", "1", "--lun", "1", "-b", str(self.lun)),
                     ("--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL"),
                     ("--op", "new", "--mode", "account", "--user", CHAP_USER, "--password", CHAP_PASSWORD),
                     ("--op", "bind", "--mode", "account", "--tid", "1", "--user", CHAP_USER)):
            done = self._admin(*args)
            assert done.returncode == 0, f"tgtadm {args}: {done.stderr}"


class NbdServer(TargetProcess):
    """A second QSD exporting a raw file over NBD with x509 TLS, on TCP 127.0.0.1 or a UNIX socket."""

    def __init__(self, root: Path, size: int, *, unix: bool) -> None:
        self.root = root
        self.image = sparse_file(root / "nbd.img", size)
        self.unix = unix
        self.port = free_port()
        self.socket = root / "nbd.sock"
        self.log = root / "nbd-qsd.log"
        self.server_dir, self.client_dir = root / "tls-server", root / "tls-client"
        mint_x509(root, self.server_dir, self.client_dir)

    @property
    def url(self) -> str:
        if self.unix:
            return f"nbd+unix:///pool?socket={self.socket}"
        return f"nbd://127.0.0.1:{self.port}/pool"

    async def start(self) -> None:
        address = (f"addr.type=unix,addr.path={self.socket}" if self.unix
                   else f"addr.type=inet,addr.host=127.0.0.1,addr.port={self.port}")
        self.socket.unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                bundled("qemu-storage-daemon"),
                "--object", f"tls-creds-x509,id=tls0,dir={self.server_dir},endpoint=server,verify-peer=on",
                "--blockdev", f"driver=file,node-name=disk,filename={self.image},cache.direct=on",
                "--nbd-server", f"{address},tls-creds=tls0",
                "--export", "type=nbd,id=pool,node-name=disk,name=pool,writable=on",
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        await until(self._listening, lambda: f"the NBD server; its log:\n{self.log.read_text()}", 20)

    async def _listening(self) -> bool:
        assert self.proc is not None and self.proc.returncode is None, self.log.read_text()
        try:
            if self.unix:
                _, writer = await asyncio.open_unix_connection(str(self.socket))
            else:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return False
        writer.close()
        await writer.wait_closed()
        return True


def mint_x509(root: Path, server_dir: Path, client_dir: Path) -> None:
    """QEMU's x509 directories: ca-cert.pem with server-cert/key.pem and client-cert/key.pem, one CA."""
    pki = root / "pki"
    pki.mkdir()
    ca = Authority(pki, "nbd")
    server, client = ca.issue("nbd-server", server=True), ca.issue("nbd-client", server=False)
    for directory, role, files in ((server_dir, "server", server), (client_dir, "client", client)):
        directory.mkdir(mode=0o700)
        shutil.copy(ca.ca_path, directory / "ca-cert.pem")
        shutil.copy(files.cert, directory / f"{role}-cert.pem")
        shutil.copy(files.key, directory / f"{role}-key.pem")
