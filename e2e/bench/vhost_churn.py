"""VM clients coming and going while other volumes change, with vhost-user-blk exports placed three ways.

Run as ``.venv/bin/python -m e2e.bench.vhost_churn [--qsd 11] [--runs 10]``
(root). It prints counts, never pass/fail.

The churn of tests/integration/test_vhost_churn.py, from
testing/helpers/vhost_clients.py (a client connects to a published VM
volume's socket and leaves, again and again, while other VM volumes are
created, staged, snapshotted, unstaged and deleted, until 500
connections), run ``--runs`` times for each placement of the exports:

  main  QSD's main loop (what the driver does on QSD >= 10)
  one   every export in the first iothread of the pool
  pool  spread over a pool of two iothreads, the least loaded first
  shards  main loops of two QSD processes (``--qsd-shards 2``): the other
        volumes land on either, so graph changes run beside the VM's
        shard and inside it

The driver's own choice (`csi_qsd.qsd.features`) is overridden in this process
only. Per placement: runs, connections, runs in which QSD died (an abort:
the supervisor restarted it) and runs in which a QMP command failed inside
QSD (the first error of each kind printed). On QSD 10.0.13 an export in an
iothread aborts QSD; on 11.1.3 it does not, but later graph changes fail
with EBADF.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import sys

import grpc

from csi_qsd.qsd import features
from csi_qsd.sys.tools import bundled
from e2e.bench.report_tables import table
from e2e.bench.served_bench import missing
from e2e.bench.sizes import MIB
from e2e.bench.staged_volumes import stage
from testing.harness import in_process_driver, qsd_pid, sandbox
from testing.helpers.vhost_clients import CONNECTIONS, VM, come_and_go, graph_round

PLACEMENTS = ("main", "one", "pool", "shards")
ALWAYS = (0, 0, 0)


@dataclasses.dataclass
class Tally:
    runs: int = 0
    connections: int = 0
    died: int = 0
    failed: int = 0
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


def place(placement: str) -> None:
    """Override the driver's choice of where exports run, in this process."""
    in_main = placement in ("main", "shards")
    features.VHOST_IOTHREAD_SAFE = None if in_main else ALWAYS
    features.VHOST_SPREAD_SAFE = ALWAYS if placement == "pool" else None
    if in_main:
        # 7.2 and older run exports in iothreads whatever the setting: not measured here.
        features.VHOST_IOTHREAD_ABORTS = ALWAYS


async def one_run(qsd: str, placement: str, tally: Tally, connections: int = CONNECTIONS) -> None:
    place(placement)
    with sandbox() as box:
        shards = 2 if placement == "shards" else 1
        async with in_process_driver(box, qsd_binary=qsd, iothreads=2, qsd_shards=shards) as (driver, csi):
            def alive() -> tuple[list[int | None], list[int]]:
                return ([qsd_pid(box, k) for k in range(shards)], [d.restarts for d in driver.qsd.daemons])

            before = alive()
            target = (await stage(csi, box, "pvc-vm-churn", 32 * MIB, VM)).target
            stop, count = asyncio.Event(), [0]
            clients = asyncio.create_task(come_and_go(str(target / "vhost-user-blk.sock"), stop, count))
            deadline = asyncio.get_running_loop().time() + 240
            i = 0
            try:
                while count[0] < connections and asyncio.get_running_loop().time() < deadline:
                    await graph_round(csi, box, i)
                    i += 1
            except grpc.aio.AioRpcError as exc:
                tally.failed += 1
                tally.errors[f"{exc.code().name}: {(exc.details() or '')[:160]}"] += 1
            finally:
                stop.set()
                try:
                    await clients
                except OSError as exc:  # QSD went away under the clients
                    tally.errors[f"client: {exc!r}"[:160]] += 1
            tally.runs += 1
            tally.connections += count[0]
            if alive() != before:
                tally.died += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--qsd", default="11", choices=["10", "11"], help="the install's qemu-storage-daemon-N")
    parser.add_argument("--runs", type=int, default=5, help="runs per placement")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated: main, one, pool, shards")
    parser.add_argument("--connections", type=int, default=CONNECTIONS, help="churn to this many a run (default 500)")
    args = parser.parse_args(argv)
    if missing():
        return 2
    qsd = bundled(f"qemu-storage-daemon-{args.qsd}")
    rows = []
    for placement in args.placements.split(","):
        tally = Tally()
        for _ in range(args.runs):
            asyncio.run(one_run(qsd, placement, tally, args.connections))
        errors = "; ".join(f"{n}x {text}" for text, n in tally.errors.most_common(2)) or "-"
        rows.append([placement, str(tally.runs), str(tally.connections), str(tally.died), str(tally.failed), errors])
        print(f"{placement}: {rows[-1][1:]}", file=sys.stderr, flush=True)
    print(f"QSD {args.qsd} (qemu-storage-daemon-{args.qsd}), churn to {args.connections} connections a run")
    print(table(["placement", "runs", "connections", "QSD died", "calls failed", "errors"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
