"""Fuzz every RPC of the served driver: spec-allowed codes only, the driver stays up, nothing escapes, nothing leaks.

`csi-qsd serve` runs as its own process on a sandbox (real QSD, FUSE, loop
devices, mounts) and hypothesis sends it generated requests over gRPC's
sync client: random and malformed IDs, names, paths (`..`, symlinks that
lead out of the target root, NUL bytes, 4 KiB strings), sizes, capabilities,
parameters, secrets and topology. Most requests are invalid and cheap; a
share of each batch are valid lifecycles (create, stage, publish, stats,
snapshot, restore, unpublish, unstage, delete) so the real code paths run,
and random requests also name the IDs of volumes that exist, so a random
request can stage, publish or delete for real.

After every batch: each answer carried a code the spec allows for its RPC
(`ALLOWED`), Probe still answers, and the sentinel tree outside the target
root is unchanged (entries, modes, mtimes, contents). After the run,
everything still made is deleted and the driver stopped; then no mount or
loop device under the sandbox, no export or block node in QSD, no image in
the pool and no catalog row may be left.

The fixed-seed run (derandomized) is part of the suite; set
CSI_QSD_FUZZ_EXAMPLES (batches of BATCH requests) for a longer random run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from csi_qsd.cli.client import capability
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.sys import mounts
from testing.harness import Sandbox
from testing.helpers.fuzz_codes import ALLOWED
from testing.leftovers import host_leftovers, qsd_leftovers

MIB = 1 << 20
INT64_MAX = (1 << 63) - 1  # 2**63 itself does not fit the int64 fields; the largest value that does
Code = grpc.StatusCode
BATCH = 20
DEFAULT_BATCHES = 520  # 10,400 random requests plus the lifecycles
BATCHES = int(os.environ.get("CSI_QSD_FUZZ_EXAMPLES", "0")) or DEFAULT_BATCHES
MIN_REQUESTS = 10_000
TOPOLOGY_KEY = "topology.csi-qsd.io/node"
Mode = pb.VolumeCapability.AccessMode


# the served driver -------------------------------------------------------------


@dataclasses.dataclass
class FuzzRun:
    """The driver process, its stubs, and what the run made (for cleanup and for known IDs)."""

    box: Sandbox
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    stubs: dict[str, Any]
    outside: Path
    volumes: list[str] = dataclasses.field(default_factory=list)
    snapshots: list[str] = dataclasses.field(default_factory=list)
    groups: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    staged: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    published: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    requests: int = 0
    random: int = 0
    codes: dict[str, int] = dataclasses.field(default_factory=dict)
    lifecycles: int = 0

    def call(self, method: str, request: Message) -> tuple[Code, Any, str]:
        """Send one request; record what it made; return (code, response, details)."""
        self.requests += 1
        try:
            response = self.stubs[method](request, timeout=120)
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
            self.codes[code.name] = self.codes.get(code.name, 0) + 1
            return code, None, details
        self.codes["OK"] = self.codes.get("OK", 0) + 1
        self._remember(method, request, response)
        return Code.OK, response, ""

    def _remember(self, method: str, request: Any, response: Any) -> None:
        if method == "CreateVolume" and response.volume.volume_id not in self.volumes:
            self.volumes.append(response.volume.volume_id)
        elif method == "CreateSnapshot" and response.snapshot.snapshot_id not in self.snapshots:
            self.snapshots.append(response.snapshot.snapshot_id)
        elif method == "CreateVolumeGroupSnapshot":
            group = response.group_snapshot
            self.groups[group.group_snapshot_id] = [s.snapshot_id for s in group.snapshots]
        elif method == "NodeStageVolume":
            self.staged.add((request.volume_id, request.staging_target_path))
        elif method == "NodePublishVolume":
            self.published.add((request.volume_id, request.target_path))


def _stubs(channel: grpc.Channel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for service, stub in (("Identity", pb_grpc.IdentityStub), ("Controller", pb_grpc.ControllerStub),
                          ("Node", pb_grpc.NodeStub), ("GroupController", pb_grpc.GroupControllerStub)):
        instance = stub(channel)
        for method in pb.DESCRIPTOR.services_by_name[service].methods_by_name:
            out[method] = getattr(instance, method)
    return out


def _traps(box: Sandbox) -> Path:
    """The sentinel tree outside the root, and symlinks inside the root that lead out of it."""
    outside = box.root / "outside"
    (outside / "keep" / "deeper").mkdir(parents=True)
    (outside / "keep" / "precious.txt").write_bytes(b"must survive every request\n")
    (outside / "nothere-parent").mkdir()
    plugins = box.kubelet / "plugins"
    (plugins / "staging").mkdir(parents=True)
    for i in range(4):
        (box.kubelet / "pods" / f"p{i}").mkdir(parents=True)
    (plugins / "evil").symlink_to(outside)
    (plugins / "dangling").symlink_to(outside / "nothere")
    (box.kubelet / "pods" / "p0" / "dangling").symlink_to(outside / "nothere-parent" / "x")
    (plugins / "state").symlink_to(box.state_dir)
    (plugins / "top").symlink_to(box.kubelet)
    return outside


def snapshot_tree(root: Path) -> list[tuple[str, int, int, bytes]]:
    out = []
    for entry in sorted([root, *root.rglob("*")]):
        st_ = entry.lstat()
        data = entry.read_bytes() if entry.is_file() and not entry.is_symlink() else b""
        out.append((str(entry), st_.st_mode, st_.st_mtime_ns, data))
    return out


@pytest.fixture
def run(box: Sandbox) -> Iterator[FuzzRun]:
    outside = _traps(box)
    log = open(box.root / "driver.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "csi_qsd.cli", "serve", "--state-dir", str(box.state_dir),
         "--target-root", str(box.kubelet), "--node-id", "node-a", "--log-level", "warning"],
        stdout=log, stderr=log, start_new_session=True,
    )
    log.close()
    channel = grpc.insecure_channel(box.endpoint)
    stubs = _stubs(channel)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (box.root / "driver.log").read_text()[-4000:]
            try:
                if stubs["Probe"](pb.ProbeRequest(), timeout=2).ready.value:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "driver not ready in 60 s"
            time.sleep(0.1)
        yield FuzzRun(box, proc, channel, stubs, outside)
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# what requests are made of --------------------------------------------------------

MALFORMED_IDS = [
    "", " ", "vol-", "vol-" + "0" * 23, "vol-" + "0" * 25, "VOL-" + "a" * 24, "vol-" + "g" * 24,
    "vol-" + "0" * 24 + "\n", "vol-\x00" + "0" * 19, "../" * 10 + "etc/passwd", "/etc/passwd", "vol-../../x",
    "snap-" + "0" * 24, "group-" + "0" * 24, "%s%n", "\u2028", "x" * 4096, "vol-" + "0" * 24 + "/..",
]
UNKNOWN_IDS = {"volume": "vol-" + "f" * 24, "snapshot": "snap-" + "f" * 24, "group": "group-" + "f" * 24}
NAMES = [f"pvc-f{i}" for i in range(6)] + [
    "", "..", "a/b", "pvc x", "-pvc", "p" * 129, "pvc-\x00", "pvc-\n", "x" * 4096, "pvc-\u00e9", "snap/../x",
]
# No "xfs" here: mkfs.xfs refuses volumes under 300 MB and staging one answers INTERNAL
# (test_stage_as_xfs_below_its_minimum_size, a domain fix); the lifecycles stage xfs on 320 MiB.
FS_TYPES = ["", "ext4", "btrfs", "ext3", "../ext4", "XFS", "x" * 4096, "ext4\x00"]
MOUNT_FLAGS = ["noatime", "nodev", "ro", "bind", "remount", "loop=/dev/loop0", "ro,bind", "a b", "", "-o",
               "x" * 4096, "nosuid\x00", "discard"]
GROUPS = ["", "0", "1000", "4294967294", "4294967295", "-1", "wheel", "\u00b2", " 5", "99999999999"]
PARAM_KEYS = ["format", "preallocation", "export", "discard", "detectZeroes", "numQueues", "logicalBlockSize",
              "cache", "iothreadPollMaxNs", "csi.storage.k8s.io/pvc/name", "fromat", "", "x" * 4096]
PARAM_VALUES = ["qcow2", "raw", "off", "metadata", "falloc", "full", "filesystem", "vhost-user-blk", "unmap",
                "ignore", "on", "1", "64", "65", "0", "512", "4096", "writethrough", "writeback", "-5", "",
                "x" * 4096, "\x00"]
SIZES = [0, 1, -1, -(1 << 63), INT64_MAX, 4096, MIB, MIB + 1, 16 * MIB, 64 * MIB, 1 << 40, 1 << 50]
# NodeExpandVolume really grows a staged volume's filesystem: the sizes stay small, so one
# request cannot write gigabytes of ext4 metadata (huge sizes: test_node_expand_to_an_absurd_size).
EXPAND_SIZES = [0, 1, -1, -(1 << 63), MIB, 16 * MIB, 48 * MIB, 96 * MIB]
SEGMENT_VALUES = ["node-a", "node-b", "", "x" * 4096]


class Draw:
    """Hypothesis draws for the parts of requests, resolved against the live run."""

    def __init__(self, data: st.DataObject, run: FuzzRun) -> None:
        self.data = data
        self.run = run
        box = run.box
        k = str(box.kubelet)
        self.paths: list[Callable[[], str]] = [
            lambda: f"{k}/plugins/staging/s{self.int(0, 3)}",
            lambda: f"{k}/pods/p{self.int(0, 3)}/volume",
            lambda: f"{k}/plugins/../../outside/keep",
            lambda: f"{k}/plugins/evil/keep/deeper",
            lambda: f"{k}/plugins/evil",
            lambda: f"{k}/plugins/dangling",
            lambda: f"{k}/pods/p0/dangling",
            lambda: f"{k}/plugins/state/exports/x",
            lambda: f"{k}/plugins/top",
            lambda: f"{k}/plugins/staging/s\x00x",
            lambda: f"{k}/" + "x" * 4096,
            lambda: "some/path",
            lambda: "/etc",
            lambda: "/",
            lambda: "",
            lambda: k,
            lambda: f"{k}/plugins/staging/s0/",
            lambda: f"{k}//pods/p1/volume",
            lambda: str(box.state_dir / "pool" / "x"),
            lambda: str(run.outside / "keep" / "precious.txt"),
            lambda: f"{k}/plugins/staging/" + self.text(),
        ]

    def draw(self, strategy: st.SearchStrategy[Any]) -> Any:
        return self.data.draw(strategy)

    def int(self, lo: int, hi: int) -> int:
        return int(self.draw(st.integers(lo, hi)))

    def one(self, values: list[Any]) -> Any:
        return self.draw(st.sampled_from(values))

    def text(self) -> str:
        return str(self.draw(st.text(max_size=24)))

    def chance(self, percent: int) -> bool:
        return self.int(0, 99) < percent

    def id(self, kind: str) -> str:
        known = {"volume": self.run.volumes, "snapshot": self.run.snapshots, "group": list(self.run.groups)}[kind]
        # Every branch draws the same shape whatever the run holds: hypothesis requires the draws
        # to depend on drawn values only, so a known ID is picked by a drawn index, not from the list.
        choice, index = self.int(0, 9), self.int(0, 255)
        if choice < 4 and known:
            return known[index % len(known)]
        if choice < 6:
            return UNKNOWN_IDS[kind]
        if choice < 9:
            return str(self.one(MALFORMED_IDS))
        return self.text()

    def name(self) -> str:
        return str(self.one(NAMES)) if self.chance(80) else self.text()

    def path(self) -> str:
        return str(self.one(self.paths)())

    def size(self, sizes: list[int] = SIZES) -> pb.CapacityRange | None:
        if self.chance(15):
            return None
        return pb.CapacityRange(required_bytes=self.one(sizes), limit_bytes=self.one(sizes) if self.chance(40) else 0)

    def mapping(self, keys: list[str], values: list[str]) -> dict[str, str]:
        if self.chance(50):
            return {}
        return {self.one(keys) if self.chance(85) else self.text(): self.one(values) if self.chance(85)
                else self.text() for _ in range(self.int(1, 3))}

    def params(self) -> dict[str, str]:
        return self.mapping(PARAM_KEYS, PARAM_VALUES)

    def secrets(self) -> dict[str, str]:
        return self.mapping(["password", "user", "x" * 4096, ""], ["secret", "", "\x00", "x" * 4096])

    def capability(self) -> pb.VolumeCapability | None:
        shape = self.int(0, 9)
        if shape == 0:
            return None
        mode = self.one([Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER,
                         Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY, Mode.MULTI_NODE_MULTI_WRITER,
                         Mode.UNKNOWN, 99]) if self.chance(60) else Mode.SINGLE_NODE_WRITER
        cap = pb.VolumeCapability()
        if shape != 1:
            cap.access_mode.mode = mode
        if shape == 2:
            return cap  # no access type
        if self.chance(35):
            cap.block.SetInParent()
        else:
            cap.mount.fs_type = self.one(FS_TYPES) if self.chance(40) else ""
            if self.chance(30):
                cap.mount.mount_flags.extend(self.one(MOUNT_FLAGS) for _ in range(self.int(1, 3)))
            if self.chance(20):
                cap.mount.volume_mount_group = self.one(GROUPS)
        return cap

    def capabilities(self) -> list[pb.VolumeCapability]:
        return [c for c in (self.capability() for _ in range(self.int(0, 3))) if c is not None]

    def topology(self) -> pb.Topology:
        return pb.Topology(segments={self.one([TOPOLOGY_KEY, "zone", "x" * 4096]) if self.chance(80) else self.text():
                                     self.one(SEGMENT_VALUES)})

    def requirement(self) -> pb.TopologyRequirement | None:
        if self.chance(70):
            return None
        return pb.TopologyRequirement(requisite=[self.topology() for _ in range(self.int(0, 2))],
                                      preferred=[self.topology() for _ in range(self.int(0, 2))])

    def source(self) -> pb.VolumeContentSource | None:
        kind = self.int(0, 4)
        if kind < 3:
            return None
        if kind == 3:
            return pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=self.id("snapshot")))
        return pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(volume_id=self.id("volume")))


def _request(d: Draw, method: str) -> Message:
    """A random request for `method`: every field drawn, most of them wrong somehow."""
    if method in ("GetPluginInfo", "GetPluginCapabilities", "Probe", "ControllerGetCapabilities",
                  "NodeGetCapabilities", "NodeGetInfo", "GroupControllerGetCapabilities"):
        return getattr(pb, f"{method}Request")()
    if method == "CreateVolume":
        return pb.CreateVolumeRequest(
            name=d.name(), capacity_range=d.size(), volume_capabilities=d.capabilities(), parameters=d.params(),
            secrets=d.secrets(), volume_content_source=d.source(), accessibility_requirements=d.requirement(),
            mutable_parameters=d.params() if d.chance(10) else {},
        )
    if method == "DeleteVolume":
        return pb.DeleteVolumeRequest(volume_id=d.id("volume"), secrets=d.secrets())
    if method == "ControllerPublishVolume":
        return pb.ControllerPublishVolumeRequest(volume_id=d.id("volume"), node_id=d.one(SEGMENT_VALUES),
                                                 volume_capability=d.capability(), readonly=d.chance(50))
    if method == "ControllerUnpublishVolume":
        return pb.ControllerUnpublishVolumeRequest(volume_id=d.id("volume"), node_id=d.one(SEGMENT_VALUES))
    if method == "ValidateVolumeCapabilities":
        return pb.ValidateVolumeCapabilitiesRequest(volume_id=d.id("volume"), volume_capabilities=d.capabilities(),
                                                    parameters=d.params(), volume_context=d.params())
    if method == "ListVolumes":
        return pb.ListVolumesRequest(max_entries=d.one([0, 1, 2, -1, 2**31 - 1, -(2**31)]),
                                     starting_token=d.one(["", d.id("volume"), "bogus", "' OR 1=1 --"]))
    if method == "ControllerGetVolume":
        return pb.ControllerGetVolumeRequest(volume_id=d.id("volume"))
    if method == "ControllerModifyVolume":
        return pb.ControllerModifyVolumeRequest(volume_id=d.id("volume"), mutable_parameters=d.params())
    if method == "GetCapacity":
        return pb.GetCapacityRequest(volume_capabilities=d.capabilities(), parameters=d.params(),
                                     accessible_topology=d.topology() if d.chance(30) else None)
    if method == "CreateSnapshot":
        return pb.CreateSnapshotRequest(source_volume_id=d.id("volume"), name=d.name(), parameters=d.params(),
                                        secrets=d.secrets())
    if method == "DeleteSnapshot":
        return pb.DeleteSnapshotRequest(snapshot_id=d.id("snapshot"), secrets=d.secrets())
    if method == "ListSnapshots":
        return pb.ListSnapshotsRequest(max_entries=d.one([0, 1, -1, 2**31 - 1]), starting_token=d.one(["", "bogus"]),
                                       source_volume_id=d.id("volume") if d.chance(30) else "",
                                       snapshot_id=d.id("snapshot") if d.chance(30) else "")
    if method == "GetSnapshot":
        return pb.GetSnapshotRequest(snapshot_id=d.id("snapshot"))
    if method == "ControllerExpandVolume":
        return pb.ControllerExpandVolumeRequest(volume_id=d.id("volume"), capacity_range=d.size())
    if method == "NodeStageVolume":
        return pb.NodeStageVolumeRequest(volume_id=d.id("volume"), staging_target_path=d.path(),
                                         volume_capability=d.capability(), secrets=d.secrets(),
                                         volume_context=d.params(), publish_context=d.params())
    if method == "NodeUnstageVolume":
        return pb.NodeUnstageVolumeRequest(volume_id=d.id("volume"), staging_target_path=d.path())
    if method == "NodePublishVolume":
        return pb.NodePublishVolumeRequest(volume_id=d.id("volume"), staging_target_path=d.path(),
                                           target_path=d.path(), volume_capability=d.capability(),
                                           readonly=d.chance(30), secrets=d.secrets(), volume_context=d.params())
    if method == "NodeUnpublishVolume":
        return pb.NodeUnpublishVolumeRequest(volume_id=d.id("volume"), target_path=d.path())
    if method == "NodeGetVolumeStats":
        return pb.NodeGetVolumeStatsRequest(volume_id=d.id("volume"), volume_path=d.path(),
                                            staging_target_path=d.path() if d.chance(30) else "")
    if method == "NodeExpandVolume":
        return pb.NodeExpandVolumeRequest(volume_id=d.id("volume"), volume_path=d.path(),
                                          capacity_range=d.size(EXPAND_SIZES),
                                          staging_target_path=d.path() if d.chance(30) else "",
                                          volume_capability=d.capability() if d.chance(30) else None,
                                          secrets=d.secrets())
    if method == "CreateVolumeGroupSnapshot":
        return pb.CreateVolumeGroupSnapshotRequest(name=d.name(), source_volume_ids=[d.id("volume") for _ in range(
            d.int(0, 3))], parameters=d.params(), secrets=d.secrets())
    if method in ("DeleteVolumeGroupSnapshot", "GetVolumeGroupSnapshot"):
        group = d.id("group")
        members = d.run.groups.get(group, []) if d.chance(60) else [d.id("snapshot") for _ in range(d.int(0, 2))]
        return getattr(pb, f"{method}Request")(group_snapshot_id=group, snapshot_ids=members, secrets=d.secrets())
    raise AssertionError(f"no generator for {method}")


METHODS = sorted(ALLOWED)


# valid lifecycles ---------------------------------------------------------------


def _lifecycle(d: Draw) -> None:
    """One valid sequence with drawn choices; every step must succeed."""
    run, k = d.run, d.run.box.kubelet
    n = run.lifecycles
    run.lifecycles += 1
    vhost = d.chance(20)
    block = not vhost and d.chance(35)
    fmt = "qcow2" if vhost or d.chance(75) else "raw"
    params = {"format": fmt, **({"export": "vhost-user-blk"} if vhost else {})}
    fs_type = "" if block else d.one(["ext4", "xfs", ""])
    cap = pb.VolumeCapability(access_mode=pb.VolumeCapability.AccessMode(mode=Mode.SINGLE_NODE_WRITER))
    if block:
        cap.block.SetInParent()
    else:
        cap.mount.fs_type = fs_type
    size = (320 if fs_type == "xfs" else d.one([16, 32, 64])) * MIB
    staging, target = str(k / "plugins" / "staging" / f"life{n}"), str(k / "pods" / f"p{n % 4}" / f"life{n}")

    def ok(method: str, request: Message) -> Any:
        code, response, details = run.call(method, request)
        assert code == Code.OK, f"lifecycle {n} {method}: {code.name} {details!r} for {request!r}"
        return response

    vid = ok("CreateVolume", pb.CreateVolumeRequest(name=f"life-{n}", capacity_range=pb.CapacityRange(
        required_bytes=size), volume_capabilities=[cap], parameters=params)).volume.volume_id
    Path(staging).mkdir(exist_ok=True)
    ok("NodeStageVolume", pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=staging, volume_capability=cap))
    readonly = d.chance(30)
    ok("NodePublishVolume", pb.NodePublishVolumeRequest(volume_id=vid, staging_target_path=staging, target_path=target,
                                                        volume_capability=cap, readonly=readonly))
    ok("NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=target))
    if fmt == "qcow2" and d.chance(50):
        sid = ok("CreateSnapshot", pb.CreateSnapshotRequest(source_volume_id=vid, name=f"life-snap-{n}")).snapshot
        restored = ok("CreateVolume", pb.CreateVolumeRequest(
            name=f"life-restored-{n}", volume_capabilities=[cap], capacity_range=pb.CapacityRange(required_bytes=size),
            volume_content_source=pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(
                snapshot_id=sid.snapshot_id)))).volume.volume_id
        ok("DeleteVolume", pb.DeleteVolumeRequest(volume_id=restored))
        ok("DeleteSnapshot", pb.DeleteSnapshotRequest(snapshot_id=sid.snapshot_id))
    ok("NodeUnpublishVolume", pb.NodeUnpublishVolumeRequest(volume_id=vid, target_path=target))
    ok("NodeUnstageVolume", pb.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=staging))
    if d.chance(70):
        ok("DeleteVolume", pb.DeleteVolumeRequest(volume_id=vid))
    # else: the volume stays, and later random requests may name it


# the run ------------------------------------------------------------------------


def _check_batch(run: FuzzRun, before: list[tuple[str, int, int, bytes]]) -> None:
    assert run.proc.poll() is None, f"driver exited: {(run.box.root / 'driver.log').read_text()[-4000:]}"
    code, _, details = run.call("Probe", pb.ProbeRequest())
    assert code == Code.OK, f"Probe: {code.name} {details!r}"
    assert snapshot_tree(run.outside) == before, "a request touched a path outside the driver's root"
    assert not any(run.outside == e.mount_point or run.outside in e.mount_point.parents for e in mounts.mount_table())


def _cleanup(run: FuzzRun) -> None:
    """Delete everything the run made, through the driver, in the order the spec wants."""
    for vid, target in sorted(run.published):
        run.call("NodeUnpublishVolume", pb.NodeUnpublishVolumeRequest(volume_id=vid, target_path=target))
    for vid, staging in sorted(run.staged):
        code, _, details = run.call("NodeUnstageVolume", pb.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path=staging))
        assert code in (Code.OK, Code.NOT_FOUND), f"cleanup unstage {vid}: {code.name} {details!r}"
    for group, members in run.groups.items():
        run.call("DeleteVolumeGroupSnapshot", pb.DeleteVolumeGroupSnapshotRequest(
            group_snapshot_id=group, snapshot_ids=members))
    listed = run.stubs["ListSnapshots"](pb.ListSnapshotsRequest(), timeout=60)
    for entry in listed.entries:
        code, _, details = run.call("DeleteSnapshot", pb.DeleteSnapshotRequest(snapshot_id=entry.snapshot.snapshot_id))
        assert code == Code.OK, f"cleanup snapshot {entry.snapshot.snapshot_id}: {code.name} {details!r}"
    for entry in run.stubs["ListVolumes"](pb.ListVolumesRequest(), timeout=60).entries:
        code, _, details = run.call("DeleteVolume", pb.DeleteVolumeRequest(volume_id=entry.volume.volume_id))
        assert code == Code.OK, f"cleanup volume {entry.volume.volume_id}: {code.name} {details!r}"
    assert not run.stubs["ListVolumes"](pb.ListVolumesRequest(), timeout=60).entries
    assert not run.stubs["ListSnapshots"](pb.ListSnapshotsRequest(), timeout=60).entries


def _assert_nothing_left(run: FuzzRun) -> None:
    box = run.box
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(60) == 0, (box.root / "driver.log").read_text()[-4000:]
    exports, nodes = asyncio.run(qsd_leftovers(box.state_dir, quit_after=True))
    assert not exports and not nodes, f"QSD still holds exports {sorted(exports)} and nodes {sorted(nodes)}"
    left = host_leftovers(box.root)
    assert not left, f"left behind: {left}"
    images = [p.name for p in (box.state_dir / "pool").iterdir() if p.name.startswith(("vol-", "snap-"))]
    assert not images, f"images left in the pool: {images}"
    with sqlite3.connect(f"file:{box.state_dir / 'catalog.db'}?mode=ro", uri=True) as db:
        for table in ("volumes", "snapshots", "groups", "stages", "publishes"):
            (rows,) = db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()  # noqa: S608 - fixed names
            assert rows == 0, f"{rows} rows left in catalog table {table}"


def test_fuzz_every_rpc(run: FuzzRun) -> None:
    before = snapshot_tree(run.outside)
    started = time.monotonic()

    @settings(max_examples=BATCHES, derandomize=BATCHES == DEFAULT_BATCHES, deadline=None, database=None,
              phases=(Phase.explicit, Phase.generate), print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                     HealthCheck.filter_too_much])
    @given(data=st.data())
    def batch(data: st.DataObject) -> None:
        d = Draw(data, run)
        if d.chance(4):
            _lifecycle(d)
        for _ in range(BATCH):
            method = d.one(METHODS)
            request = _request(d, method)
            code, _, details = run.call(method, request)
            run.random += 1
            assert code in ALLOWED[method], f"{method}: {code.name} {details!r} for {request!r}"[:8000]
        _check_batch(run, before)

    batch()
    elapsed = time.monotonic() - started
    print(f"\nfuzz: {run.random} random requests, {run.requests} in all, {run.lifecycles} lifecycles "
          f"in {elapsed:.1f} s; codes {run.codes}")
    assert run.random >= MIN_REQUESTS or BATCHES != DEFAULT_BATCHES
    _cleanup(run)
    _assert_nothing_left(run)
    assert snapshot_tree(run.outside) == before


async def test_node_expand_to_an_absurd_size(box: Sandbox, csi: Any) -> None:
    """NodeExpandVolume to 2**63-1 bytes must be refused (OUT_OF_RANGE or RESOURCE_EXHAUSTED), as CreateVolume is.

    Kept out of the fuzz run's sizes because a size the pool cannot hold should fail fast, and
    a thin image grown to it would make resize2fs write gigabytes of metadata.
    """
    volume = (await csi.create_volume("pvc-huge", 16 * MIB)).volume_id
    staging = box.staging("huge")
    await csi.stage(volume, str(staging), fs_type="ext4")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await csi.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
            volume_id=volume, volume_path=str(staging), capacity_range=pb.CapacityRange(required_bytes=INT64_MAX)),
            timeout=120)
    assert info.value.code() in (Code.OUT_OF_RANGE, Code.RESOURCE_EXHAUSTED), info.value.details()
    assert volume in (info.value.details() or "") or str(INT64_MAX) in (info.value.details() or "")
    await csi.unstage(volume, str(staging))


async def test_stage_as_xfs_below_its_minimum_size(box: Sandbox, csi: Any) -> None:
    volume = (await csi.create_volume("pvc-small-xfs", 16 * MIB)).volume_id
    staging = box.staging("small-xfs")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await csi.stage(volume, str(staging), fs_type="xfs")
    assert info.value.code() == Code.FAILED_PRECONDITION, info.value.details()
    assert "xfs" in (info.value.details() or "") and volume in (info.value.details() or "")


async def test_an_xfs_claim_too_small_for_xfs_gets_room_for_it(box: Sandbox, csi: Any) -> None:
    """A 1 MiB claim of an xfs class (the Kubernetes e2e suite's size): CreateVolume gives the least XFS can be
    made on, so the volume stages; with a limit below that, OUT_OF_RANGE saying why."""
    created = await csi.create_volume("pvc-tiny-xfs", MIB, fs_type="xfs")
    assert created.capacity_bytes >= 300 * MIB
    staging = box.staging("tiny-xfs")
    await csi.stage(created.volume_id, str(staging), fs_type="xfs")
    await csi.unstage(created.volume_id, str(staging))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await csi.controller.CreateVolume(pb.CreateVolumeRequest(
            name="pvc-tiny-xfs-capped", capacity_range=pb.CapacityRange(required_bytes=MIB, limit_bytes=16 * MIB),
            volume_capabilities=[capability(fs_type="xfs")]), timeout=60)
    assert info.value.code() == Code.OUT_OF_RANGE, info.value.details()
    assert "xfs filesystem needs at least" in (info.value.details() or "")
