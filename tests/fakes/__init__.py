"""Test doubles for the seams the orchestrators stand on: QSD, a pool, an export kind.

The staging orchestrator, the graph rebuild, live snapshots and moves decide
*what* happens and in which order; QSD, the pools and the export kinds do
it. These doubles let the deciding code run in milliseconds, as qemu.qmp's
own tests fake the protocol:

* `qsd`: `FakeQSDClient`, a QSD as far as the domain reaches it (named
  nodes and their children, exports, QOM objects, block jobs), refusing
  what QEMU refuses where the driver depends on it (a node that exists, is
  missing or in use); `fail_next` makes the next command refused, or
  carried out with its answer lost. `FakeDaemon` holds one per shard;
  `fake_shards` puts them in a real `QSDShards`, so placement is the
  driver's own.
* `pools`: `FakePool`, images as small JSON files (size, backing), enough
  for snapshots, restores and their reconcile, which look at files.
  `FakeMovingPool` keeps each volume in a fixed home and grows it by moving
  it, as a device pool does, its homes in the catalog's extents table so a
  move's commit and the volume's new generation are one transaction.
* `exports`: `FakeExport`, an export kind whose QSD side is the driver's
  own (`attach`, `qsd.move`) over the fake client and whose host side (loop
  devices, mounts, binds, frozen filesystems) is a `FakeHostState`. It
  records every call; `at`/`fail_at` run an action (a refusal, a crash) at
  a named step.
* `crash`: `CrashAt`, failpoints that raise `Crash` instead of killing the
  process.
* `node`: `fake_node`, a node's domain assembled over them as the server
  assembles the real one.
* `context`: `FakeContext`, a gRPC servicer context that records each abort,
  for the `@rpc` decorator and the request checks without a server.
* `records`: `volume`, a catalog row made up from a number.

The integration tier runs the same code against a real QSD; these are for
the orchestration logic only. Nothing here is imported by `csi_qsd`.
"""

from __future__ import annotations

from tests.fakes.context import FakeContext
from tests.fakes.crash import Crash, CrashAt
from tests.fakes.daemons import FakeDaemon, FakeQSDClient, fake_shards
from tests.fakes.exports import Call, FakeExport, FakeExportPaths, FakeHostState
from tests.fakes.node_domain import FakeNode, fake_node
from tests.fakes.pools import FakeMovingPool, FakePool

__all__ = [
    "Call", "Crash", "CrashAt", "FakeContext", "FakeDaemon", "FakeExport", "FakeExportPaths", "FakeHostState",
    "FakeMovingPool", "FakeNode", "FakePool", "FakeQSDClient", "fake_node", "fake_shards",
]
