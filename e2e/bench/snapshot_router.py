"""Snapshot-metadata router benchmark: the same SnapshotMetadata calls straight to the node and through the router.

Two `csi-qsd serve` node plugins with mutual-TLS metadata listeners and
`csi-qsd snapshot-metadata-router` in front of them, all as processes, as in
tests/integration/test_snapshot_router.py. Node A holds a qcow2 block volume
(--size-gib, default 4): 16 scattered 4 KiB writes, snapshot S0, then
--writes more (default 20000), each in its own 64 KiB cluster, so each a
range of its own, then snapshot S1. Node B holds one snapshot of its own.
In the same run:

    small answer        GetMetadataAllocated(S0), 16 ranges: p50/p99 of --calls calls, direct (the node's
                        UNIX socket) and routed (owner cached); the router's first call (owner looked up)
    owner lookup        a routed call for an ID no node holds (NOT_FOUND once both nodes answered)
    large answer        GetMetadataDelta(S0, S1), --max-results ranges per message and then one per message:
                        time to the first message and to the end, direct and routed; the router's peak RSS
                        growth beside the answer's size

Needs root and /dev/fuse; everything is removed afterwards. Usage:

    .venv/bin/python -m e2e.bench.snapshot_router [--size-gib 4] [--writes 20000] [--calls 200] [--max-results 256]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from csi_qsd.csi_pb import csi_pb2 as pb
from e2e.bench.latencies import Summary, timed
from e2e.bench.loop_devices import write_direct
from e2e.bench.process_usage import status_field_kib
from e2e.bench.report_tables import ms, table
from e2e.bench.sizes import GIB, KIB
from e2e.bench.staged_volumes import stage
from testing.certs import mint
from testing.router_cluster import Node, Router, node_plugin

CLUSTER = 64 * KIB


async def _prepare(node: Node, size: int, writes: int) -> tuple[str, str]:
    volume = await stage(node.csi, node.box, f"pvc-{node.name}", size, block=True)
    vid, target = volume.id, volume.target
    clusters = random.Random(7).sample(range(size // CLUSTER), 16 + writes)
    await asyncio.to_thread(write_direct, target, [c * CLUSTER for c in clusters[:16]], 4 * KIB)
    s0 = (await node.csi.create_snapshot(f"s0-{node.name}", vid)).snapshot_id
    started = time.perf_counter()
    await asyncio.to_thread(write_direct, target, [c * CLUSTER + 4 * KIB * (c % 16) for c in clusters[16:]], 4 * KIB)
    print(f"{node.name}: {writes} scattered 4 KiB writes in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    s1 = (await node.csi.create_snapshot(f"s1-{node.name}", vid)).snapshot_id
    return s0, s1


async def _stream(call: Any) -> tuple[float, float, int, int]:
    """(ms to the first message, ms to the end, messages, ranges) of one server stream."""
    start = time.perf_counter()
    first = 0.0
    messages = ranges = 0
    async for message in call:
        if not messages:
            first = (time.perf_counter() - start) * 1000
        messages += 1
        ranges += len(message.block_metadata)
    return first, (time.perf_counter() - start) * 1000, messages, ranges


async def _latencies(calls: int, call: Callable[[], Any]) -> Summary:
    samples: list[float] = []
    for _ in range(calls):
        with timed(samples):
            try:
                await _stream(call())
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
    return Summary.of(samples)


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="cq-router-bench") as tmp:
        root = Path(tmp)
        pki = mint(root / "pki")
        async with node_plugin("node-a", pki) as a, node_plugin("node-b", pki) as b:
            s0, s1 = await _prepare(a, args.size_gib * GIB, args.writes)
            await b.csi.create_snapshot("only-b", (await b.csi.create_volume("pvc-b", GIB)).volume_id)
            router = Router(root, pki.router, [a, b], "--log-level", "info")
            try:
                routed = await router.start()
                assert router.proc is not None
                async with routed:
                    await report(args, a, routed, router.proc.pid, s0, s1)
            finally:
                await router.stop()


async def report(args: argparse.Namespace, a: Node, routed: Any, router_pid: int, s0: str, s1: str) -> None:
    allocated = pb.GetMetadataAllocatedRequest
    first_call = (await _latencies(1, lambda: routed.metadata.GetMetadataAllocated(allocated(snapshot_id=s0)))).p50
    direct_small = await _latencies(args.calls, lambda: a.csi.metadata.GetMetadataAllocated(allocated(snapshot_id=s0)))
    routed_small = await _latencies(args.calls, lambda: routed.metadata.GetMetadataAllocated(allocated(snapshot_id=s0)))
    unknown = f"snap-{uuid.uuid4().hex[:24]}"
    missing = await _latencies(args.calls, lambda: routed.metadata.GetMetadataAllocated(allocated(snapshot_id=unknown)))
    print(table(["GetMetadataAllocated(S0), 16 ranges", "p50", "p99", "max"], [
        ["direct (node's UNIX socket)", ms(direct_small.p50), ms(direct_small.p99), ms(direct_small.max)],
        ["routed, owner cached (UNIX + mTLS)", ms(routed_small.p50), ms(routed_small.p99), ms(routed_small.max)],
        ["routed, first call (owner looked up)", ms(first_call), "", ""],
        ["routed, unknown ID (2 nodes asked)", ms(missing.p50), ms(missing.p99), ms(missing.max)],
    ]))
    rss_before = status_field_kib(router_pid, "VmRSS")
    hwm_before = status_field_kib(router_pid, "VmHWM")
    largest = 0
    for max_results in (args.max_results, 1):
        delta = pb.GetMetadataDeltaRequest(base_snapshot_id=s0, target_snapshot_id=s1, max_results=max_results)
        size = sum([len(m.SerializeToString()) async for m in a.csi.metadata.GetMetadataDelta(delta)])
        largest = max(largest, size)
        big: dict[str, list[tuple[float, float, int, int]]] = {"direct": [], "routed": []}
        for _ in range(args.repeat):
            big["direct"].append(await _stream(a.csi.metadata.GetMetadataDelta(delta)))
            big["routed"].append(await _stream(routed.metadata.GetMetadataDelta(delta)))
        assert {r[2:] for r in big["direct"]} == {r[2:] for r in big["routed"]}, big
        _, _, messages, ranges = big["direct"][0]
        rows = []
        for how, runs in big.items():
            firsts = sorted(r[0] for r in runs)
            totals = sorted(r[1] for r in runs)
            rows.append([how, ms(firsts[len(firsts) // 2]), ms(totals[len(totals) // 2]), ms(totals[-1])])
        print()
        print(f"GetMetadataDelta(S0, S1): {ranges} ranges in {messages} messages ({max_results} per message), "
              f"{size / 1024:.0f} KiB of protobuf; median of {args.repeat}")
        print(table(["", "first message", "whole answer", "max"], rows))
    hwm_after = status_field_kib(router_pid, "VmHWM")
    print()
    print(f"router RSS {rss_before / 1024:.1f} MiB before the large answers; its peak grew by "
          f"{(hwm_after - hwm_before) / 1024:.1f} MiB while relaying them (largest {largest / 1024:.0f} KiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=int, default=4)
    parser.add_argument("--writes", type=int, default=20000)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--max-results", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
