"""Restore onto another node: time to first I/O and to fully local, beside dd of the same bytes over loopback TCP.

Two `csi-qsd serve` node plugins as processes with mutual-TLS listeners, as
in tests/integration/test_cross_node_copy.py. Node A holds a qcow2 block
volume of --size-gib (default 1) filled with random bytes, and a snapshot
of it. In the same run:

    baseline        `dd if=<A's block device> bs=1M > /dev/tcp/127.0.0.1:PORT` into a receiver that writes a file
                    and fsyncs it: the same bytes over a loopback TCP socket, no TLS, no qcow2
    first I/O       CreateVolume on node B from A's snapshot, NodeStage + NodePublish (block), and the first
                    4 KiB read from the new volume's device (it reads through NBD/TLS from A)
    fully local     from the same start until B reports the copy done (ControllerGetVolume's condition):
                    QSD's block-stream over NBD with TLS, unthrottled; its ratio to the baseline

Needs root and /dev/fuse; everything is removed afterwards. Usage:

    .venv/bin/python -m e2e.bench.cross_node [--size-gib 1] [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from csi_qsd.csi_pb import csi_pb2 as pb
from e2e.bench.loop_devices import write_direct
from e2e.bench.report_tables import table
from e2e.bench.sizes import GIB, MIB
from e2e.bench.staged_volumes import Staged, release, stage
from testing.certs import mint
from testing.harness import free_port
from testing.router_cluster import Node, node_plugin


def _receive(server: socket.socket, out: Path, done: list[int]) -> None:
    conn, _ = server.accept()
    total = 0
    with conn, open(out, "wb") as f:
        while data := conn.recv(1 << 20):
            f.write(data)
            total += len(data)
        f.flush()
        os.fsync(f.fileno())
    done.append(total)


async def _dd_over_tcp(device: Path, out: Path) -> float:
    """Seconds for dd to send the device over loopback TCP into a file, fsynced."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        done: list[int] = []
        receiver = threading.Thread(target=_receive, args=(server, out, done))
        started = time.perf_counter()
        receiver.start()
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", f"dd if={device} bs=1M iflag=direct status=none > /dev/tcp/127.0.0.1/{port}")
        assert await proc.wait() == 0
        await asyncio.to_thread(receiver.join)
        elapsed = time.perf_counter() - started
    assert done and done[0] > 0
    return elapsed


async def _condition(node: Node, volume_id: str) -> pb.VolumeCondition:
    answer: pb.ControllerGetVolumeResponse = await node.csi.controller.ControllerGetVolume(
        pb.ControllerGetVolumeRequest(volume_id=volume_id), timeout=30)
    return answer.status.volume_condition


def _first_read(device: Path) -> bytes:
    fd = os.open(device, os.O_RDONLY)
    try:
        return os.pread(fd, 4096, 0)
    finally:
        os.close(fd)


async def _restore(a: Node, b: Node, snapshot: str, size: int, name: str) -> tuple[float, float]:
    started = time.perf_counter()
    vid = (await b.csi.create_volume(name, size, block=True, from_snapshot=snapshot)).volume_id
    staging, target = b.box.staging(vid), b.box.target(vid)
    for _ in range(200):  # the fill may hold the volume a moment: ABORTED, retried as kubelet does
        try:
            await b.csi.stage(vid, str(staging), block=True)
            break
        except Exception:
            await asyncio.sleep(0.02)
    await b.csi.publish(vid, str(staging), str(target), block=True)
    await asyncio.to_thread(_first_read, target)
    first_io = time.perf_counter() - started
    while True:
        condition = await _condition(b, vid)
        if not condition.abnormal and "copied" not in condition.message:
            break
        await asyncio.sleep(0.05)
    local = time.perf_counter() - started
    await release(b.csi, Staged(vid, staging, target))
    return first_io, local


async def run(args: argparse.Namespace) -> None:
    size = int(args.size_gib * GIB) // MIB * MIB
    with tempfile.TemporaryDirectory(prefix="cq-cross-bench") as tmp:
        root = Path(tmp)
        pki = mint(root / "pki")
        a_address, b_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        # Each side names the other: node-a serves copies only to the nodes it knows (--peer).
        async with node_plugin("node-a", pki, "--peer", f"node-b={b_address}", address=a_address) as a, \
                node_plugin("node-b", pki, "--peer", f"node-a={a_address}", "--log-level", "info",
                            address=b_address) as b:
            try:
                source = await stage(a.csi, a.box, "source", size, block=True)
                vid, target = source.id, source.target
                started = time.perf_counter()
                await asyncio.to_thread(write_direct, target, range(0, size, MIB), MIB)
                print(f"node-a: {args.size_gib:g} GiB of random bytes written in {time.perf_counter() - started:.1f} s",
                      file=sys.stderr)
                snapshot = (await a.csi.create_snapshot("snap", vid)).snapshot_id
                rows = []
                for i in range(args.repeat):
                    dd = await _dd_over_tcp(target, root / f"dd-{i}.raw")
                    (root / f"dd-{i}.raw").unlink()
                    first_io, local = await _restore(a, b, snapshot, size, f"restored-{i}")
                    rows.append([str(i + 1), f"{dd:.2f} s ({size / MIB / dd:.0f} MiB/s)", f"{first_io * 1000:.0f} ms",
                                 f"{local:.2f} s ({size / MIB / local:.0f} MiB/s)", f"{local / dd:.2f}x"])
                print(table(["run", f"dd {args.size_gib:g} GiB over loopback TCP", "first I/O on node B",
                             "fully local on node B", "local / dd"], rows))
            finally:
                for pid_file in (a.box.state_dir / "copies").glob("*.pid"):
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(pid_file.read_text()), 9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
