"""Reading a copy server (qemu-nbd with TLS) as a client of it would, presenting a given certificate."""

from __future__ import annotations

import asyncio
from pathlib import Path

from csi_qsd.sys import nbd_tcp
from csi_qsd.sys.pem import PemFiles
from csi_qsd.sys.tools import bundled


async def nbd_info(address: str, export: str, files: PemFiles, directory: Path) -> tuple[bool, str, str]:
    """(whether `qemu-img info` opened the NBD export at `address` presenting `files` and checking that the server
    is node-a, its output, its error). `directory` receives the client's credentials for QEMU."""
    tls = await asyncio.to_thread(nbd_tcp.tls_dir, directory, files.cert, files.key, files.ca, endpoint="client")
    host, _, port = address.rpartition(":")
    proc = await asyncio.create_subprocess_exec(
        bundled("qemu-img"), "info", "--object", f"tls-creds-x509,id=tls0,dir={tls},endpoint=client",
        "--image-opts", f"driver=raw,file.driver=nbd,file.server.type=inet,file.server.host={host},"
        f"file.server.port={port},file.export={export},file.tls-creds=tls0,file.tls-hostname=node-a",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode == 0, out.decode(), err.decode()
