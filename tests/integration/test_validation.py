"""Every field of every CSI request is checked: a bad request gets the spec's gRPC code and a message naming it.

One table per RPC, driven against the real driver (real QSD, FUSE, loop
devices, mounts). Each row is a request built from a valid baseline with
one thing broken, the code the CSI spec asks for, and the substrings the
message must hold (the field, the parameter key, the volume ID, the path).
Each table starts with its unbroken baseline, which must succeed, so a row
fails for its own reason and not because the baseline was wrong.

After every row the sandbox's `outside` directory (a sibling of the kubelet
root that requests try to reach through `..`, absolute paths and symlinks)
is compared with its snapshot from before: a rejected request must not have
created, changed or mounted anything there.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from csi_qsd.cli.client import CSIClient, capability
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.server import Driver
from csi_qsd.sys import mounts
from testing.harness import Sandbox, in_process_driver

MIB = 1 << 20
Code = grpc.StatusCode
OK: Code | None = None
Mode = pb.VolumeCapability.AccessMode
TOPOLOGY_KEY = "topology.csi-qsd.io/node"
UNKNOWN_ID = "vol-" + "0" * 24


# the environment every row runs in ------------------------------------------


@dataclasses.dataclass
class Env:
    box: Sandbox
    driver: Driver
    csi: CSIClient
    outside: Path
    volume_id: str = ""
    vhost_id: str = ""
    staged: bool = False

    @property
    def staging(self) -> str:
        return str(self.box.kubelet / "plugins" / "staging" / "s")

    @property
    def target(self) -> str:
        return str(self.box.kubelet / "pods" / "p" / "volume")

    def fields(self) -> dict[str, str]:
        """What a row's expected substrings may name: "{volume_id}", "{staging}", "{outside}", …"""
        return {
            "kubelet": str(self.box.kubelet), "state_dir": str(self.box.state_dir), "outside": str(self.outside),
            "staging": self.staging, "target": self.target, "volume_id": self.volume_id,
            "vhost_id": self.vhost_id, "unknown": UNKNOWN_ID,
        }

    async def prepare(self, needs: str) -> None:
        if needs in ("volume", "staged"):
            self.volume_id = (await self.csi.create_volume("pvc-fs", 64 * MIB)).volume_id
        if needs == "vhost":
            self.vhost_id = (await self.csi.create_volume("pvc-vm", 64 * MIB, {"export": "vhost-user-blk"})).volume_id
        if needs == "staged":
            await self.csi.stage(self.volume_id, self.staging, fs_type="ext4")
            self.staged = True


def snapshot_tree(root: Path) -> list[tuple[str, int, int, bytes]]:
    """Every entry under `root` with its mode, mtime and (for files) content."""
    out = []
    for entry in sorted([root, *root.rglob("*")]):
        st = entry.lstat()
        data = entry.read_bytes() if entry.is_file() and not entry.is_symlink() else b""
        out.append((str(entry), st.st_mode, st.st_mtime_ns, data))
    return out


@pytest.fixture
async def env(box: Sandbox, driver: tuple[Driver, CSIClient]) -> AsyncIterator[Env]:
    """A driver plus the traps: an `outside` sentinel and symlinks in the root that lead out of it."""
    outside = box.root / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "precious.txt").write_bytes(b"must survive every request\n")
    plugins, pods = box.kubelet / "plugins" / "staging", box.kubelet / "pods" / "p"
    plugins.mkdir(parents=True)
    pods.mkdir(parents=True)
    (box.kubelet / "plugins" / "evil").symlink_to(outside)                 # escapes the root
    (box.kubelet / "plugins" / "dangling").symlink_to(outside / "nothere")  # escapes once created
    (pods / "dangling").symlink_to(outside / "nothere-either")
    (box.kubelet / "plugins" / "state").symlink_to(box.state_dir)          # into the driver's own state
    (box.kubelet / "plugins" / "top").symlink_to(box.kubelet)              # the root itself
    before = snapshot_tree(outside)
    yield Env(box, driver[0], driver[1], outside)
    assert snapshot_tree(outside) == before, "a request touched a path outside the driver's root"
    assert not any(e.mount_point == outside or outside in e.mount_point.parents for e in mounts.mount_table())


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Env], Message]
    code: Code | None                 # None: must succeed
    names: tuple[str, ...] = ()       # substrings of the message; "{field}" is filled from Env.fields()
    needs: str = "volume"             # "", "volume", "vhost" or "staged"


def table(*rows: Case | tuple[str, list[Case]]) -> list[Any]:
    """pytest params: a Case is a test of its own; (name, cases) is one test running every case on one driver.

    Groups keep the suite fast where one check repeats over many bad values
    (every bad path, every bad capability): each value is still its own row
    of the table, checked and reported on its own.
    """
    params = []
    for row in rows:
        if isinstance(row, Case):
            params.append(pytest.param([row], id=row.id))
        else:
            name, cases = row
            assert cases and len({c.needs for c in cases}) == 1 and all(c.code is not OK for c in cases), name
            params.append(pytest.param(cases, id=name))
    return params


async def check(env: Env, case: Case, call: Callable[..., Any]) -> tuple[Any, str]:
    """Send one row's request; return (response, '') or (None, what was wrong)."""
    try:
        response = await call(case.make(env), timeout=60)
    except grpc.aio.AioRpcError as error:
        got, details = error.code(), error.details() or ""
        if case.code is OK:
            return None, f"{case.id}: failed with {got.name}: {details!r}"
        if got != case.code:
            return None, f"{case.id}: got {got.name} ({details!r}), want {case.code.name}"
        missing = [w for w in (n.format_map(env.fields()) for n in case.names) if w not in details]
        if missing:
            return None, f"{case.id}: message {details!r} does not name {missing}"
        return None, ""
    if case.code is not OK:
        return response, f"{case.id}: succeeded, want {case.code.name}"
    return response, ""


async def run(env: Env, cases: list[Case], call: Callable[..., Any]) -> Any:
    """Prepare what the rows need, run each, fail with every row that went wrong; return the last response."""
    await env.prepare(cases[0].needs)
    response, failures = None, []
    for case in cases:
        response, problem = await check(env, case, call)
        if problem:
            failures.append(problem)
    assert not failures, "\n".join(failures)
    return response


# request builders ------------------------------------------------------------


def cap(**kw: Any) -> pb.VolumeCapability:
    return capability(**kw)


def cap_without_access_type() -> pb.VolumeCapability:
    return pb.VolumeCapability(access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER))


def cap_without_access_mode() -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume())


def cap_mode(mode: int) -> pb.VolumeCapability:
    return capability(mode=mode)


def create(e: Env, **kw: Any) -> pb.CreateVolumeRequest:
    fields: dict[str, Any] = dict(
        name="pvc-new", capacity_range=pb.CapacityRange(required_bytes=16 * MIB), volume_capabilities=[cap()],
    )
    fields.update(kw)
    return pb.CreateVolumeRequest(**fields)


def sized(required: int, limit: int = 0) -> pb.CapacityRange:
    return pb.CapacityRange(required_bytes=required, limit_bytes=limit)


def requisite(*nodes: str) -> pb.TopologyRequirement:
    return pb.TopologyRequirement(requisite=[pb.Topology(segments={TOPOLOGY_KEY: n}) for n in nodes])


def stage(e: Env, **kw: Any) -> pb.NodeStageVolumeRequest:
    fields: dict[str, Any] = dict(
        volume_id=e.volume_id, staging_target_path=e.staging, volume_capability=cap(fs_type="ext4"),
    )
    fields.update(kw)
    return pb.NodeStageVolumeRequest(**fields)


def unstage(e: Env, **kw: Any) -> pb.NodeUnstageVolumeRequest:
    fields: dict[str, Any] = dict(volume_id=e.volume_id, staging_target_path=e.staging)
    fields.update(kw)
    return pb.NodeUnstageVolumeRequest(**fields)


def publish(e: Env, **kw: Any) -> pb.NodePublishVolumeRequest:
    fields: dict[str, Any] = dict(
        volume_id=e.volume_id, staging_target_path=e.staging, target_path=e.target,
        volume_capability=cap(fs_type="ext4"),
    )
    fields.update(kw)
    return pb.NodePublishVolumeRequest(**fields)


def unpublish(e: Env, **kw: Any) -> pb.NodeUnpublishVolumeRequest:
    fields: dict[str, Any] = dict(volume_id=e.volume_id, target_path=e.target)
    fields.update(kw)
    return pb.NodeUnpublishVolumeRequest(**fields)


def stats(e: Env, **kw: Any) -> pb.NodeGetVolumeStatsRequest:
    fields: dict[str, Any] = dict(volume_id=e.volume_id, volume_path=e.staging)
    fields.update(kw)
    return pb.NodeGetVolumeStatsRequest(**fields)


# Bad paths, shared by every RPC that takes one: (id, path from Env, substrings of the message).
BAD_PATHS: list[tuple[str, Callable[[Env], str], tuple[str, ...]]] = [
    ("empty", lambda e: "", ("is required",)),
    ("relative", lambda e: "plugins/staging/s", ("'plugins/staging/s'", "absolute")),
    ("dot-dot", lambda e: f"{e.box.kubelet}/plugins/../../outside/x", ("{kubelet}/plugins/../../outside/x", "normalised")),
    ("dot-dot-inside", lambda e: f"{e.box.kubelet}/pods/../plugins/s", ("normalised",)),
    ("dot", lambda e: f"{e.box.kubelet}/plugins/./s", ("normalised",)),
    ("double-slash", lambda e: f"{e.box.kubelet}/plugins//s", ("normalised",)),
    ("trailing-slash", lambda e: f"{e.box.kubelet}/plugins/s/", ("normalised",)),
    ("nul-byte", lambda e: f"{e.box.kubelet}/plugins/s\x00x", ("NUL",)),
    ("too-long", lambda e: f"{e.box.kubelet}/" + "x" * 5000, ("too long",)),
    ("outside-root", lambda e: f"{e.outside}/keep", ("{outside}/keep", "outside the allowed root", "{kubelet}")),
    ("etc", lambda e: "/etc", ("'/etc'", "outside the allowed root")),
    ("slash", lambda e: "/", ("'/'", "outside the allowed root")),
    ("sibling-prefix", lambda e: f"{e.box.kubelet}-other/x", ("outside the allowed root",)),
    ("state-dir", lambda e: f"{e.box.state_dir}/exports/x", ("{state_dir}/exports/x",)),
    ("root-itself", lambda e: str(e.box.kubelet), ("'{kubelet}'", "root itself")),
    ("symlink-out", lambda e: f"{e.box.kubelet}/plugins/evil/keep", ("{kubelet}/plugins/evil/keep", "resolves to")),
    ("symlink-out-leaf", lambda e: f"{e.box.kubelet}/plugins/evil", ("resolves to", "{outside}")),
    ("dangling-symlink", lambda e: f"{e.box.kubelet}/plugins/dangling", ("resolves to", "{outside}/nothere")),
    ("symlink-to-state", lambda e: f"{e.box.kubelet}/plugins/state/x", ("resolves to", "{state_dir}")),
    ("symlink-to-root", lambda e: f"{e.box.kubelet}/plugins/top", ("resolves to",)),
]


def path_cases(
    field: str, build: Callable[..., Message], needs: str = "volume", *,
    bad: Code = Code.INVALID_ARGUMENT, empty: Code = Code.INVALID_ARGUMENT,
) -> list[Case]:
    """Every bad path in one field: `empty` is the code for an empty one, `bad` for the rest."""
    def make(path: Callable[[Env], str]) -> Callable[[Env], Message]:
        return lambda e: build(e, **{field: path(e)})
    return [
        Case(f"{field}-{name}", make(path), empty if name == "empty" else bad, (field, *names), needs)
        for name, path, names in BAD_PATHS
    ]


def capability_cases(field: str, build: Callable[..., Message], needs: str = "volume") -> list[Case]:
    """A single volume_capability: missing, half-filled, unsupported modes, fs types, flags, groups."""
    def with_cap(value: pb.VolumeCapability) -> Callable[[Env], Message]:
        return lambda e: build(e, **{field: value})
    cases = [
        Case("no-capability", lambda e: build(e, **{field: None}), Code.INVALID_ARGUMENT, (field,), needs),
        Case("no-access-type", with_cap(cap_without_access_type()), Code.INVALID_ARGUMENT,
             (field, "access_type"), needs),
        Case("no-access-mode", with_cap(cap_without_access_mode()), Code.INVALID_ARGUMENT,
             (field, "access_mode"), needs),
        Case("unknown-access-mode", with_cap(cap_mode(Mode.UNKNOWN)), Code.INVALID_ARGUMENT,
             (field, "access_mode"), needs),
        Case("undefined-access-mode", with_cap(cap_mode(99)), Code.INVALID_ARGUMENT, ("access_mode",), needs),
        Case("bad-fs-type", with_cap(cap(fs_type="btrfs")), Code.INVALID_ARGUMENT, ("fs_type", "'btrfs'"), needs),
        Case("fs-type-ext3", with_cap(cap(fs_type="ext3")), Code.INVALID_ARGUMENT, ("'ext3'",), needs),
        Case("flag-bind", with_cap(cap(mount_flags=("noatime", "bind"))), Code.INVALID_ARGUMENT,
             ("mount flag 'bind'", "not allowed"), needs),
        Case("flag-remount", with_cap(cap(mount_flags=("remount",))), Code.INVALID_ARGUMENT, ("'remount'",), needs),
        Case("flag-loop", with_cap(cap(mount_flags=("loop=/dev/loop0",))), Code.INVALID_ARGUMENT,
             ("'loop=/dev/loop0'",), needs),
        Case("flag-smuggled", with_cap(cap(mount_flags=("ro,bind",))), Code.INVALID_ARGUMENT,
             ("'ro,bind'", "malformed"), needs),
        Case("flag-space", with_cap(cap(mount_flags=("ro rw",))), Code.INVALID_ARGUMENT, ("'ro rw'",), needs),
        Case("flag-newline", with_cap(cap(mount_flags=("ro\n",))), Code.INVALID_ARGUMENT, ("malformed",), needs),
        Case("flag-empty", with_cap(cap(mount_flags=("",))), Code.INVALID_ARGUMENT, ("malformed",), needs),
        Case("flag-dash", with_cap(cap(mount_flags=("-o",))), Code.INVALID_ARGUMENT, ("'-o'",), needs),
    ]
    for mode in ("MULTI_NODE_READER_ONLY", "MULTI_NODE_SINGLE_WRITER", "MULTI_NODE_MULTI_WRITER"):
        cases.append(Case(f"mode-{mode}", with_cap(cap_mode(Mode.Mode.Value(mode))), Code.INVALID_ARGUMENT,
                          (mode, "node-local"), needs))
    for group in ("wheel", "-1", "1.5", "4294967295", "99999999999", "\u00b2", "\u0663", " 5"):
        cases.append(Case(f"mount-group-{group.encode('unicode_escape').decode()}",
                          with_cap(cap(mount_group=group)), Code.INVALID_ARGUMENT,
                          ("volume_mount_group", repr(group)), needs))
    return cases


# CreateVolume ----------------------------------------------------------------

VHOST = {"export": "vhost-user-blk"}
CREATE_CASES = table(
    Case("baseline", lambda e: create(e), OK, needs=""),
    Case("baseline-provisioner-keys", lambda e: create(e, parameters={"csi.storage.k8s.io/pvc/name": "x"}),
         OK, needs=""),
    Case("baseline-requisite-includes-node", lambda e: create(e, accessibility_requirements=requisite("node-b", "node-a")),
         OK, needs=""),
    Case("baseline-no-capacity", lambda e: create(e, capacity_range=None), OK, needs=""),
    ("bad-names", [
        Case("empty-name", lambda e: create(e, name=""), Code.INVALID_ARGUMENT, ("name is required",), ""),
        Case("name-slash", lambda e: create(e, name="pvc/x"), Code.INVALID_ARGUMENT, ("name 'pvc/x'",), ""),
        Case("name-dot-dot", lambda e: create(e, name=".."), Code.INVALID_ARGUMENT, ("name '..'",), ""),
        Case("name-space", lambda e: create(e, name="pvc x"), Code.INVALID_ARGUMENT, ("'pvc x'",), ""),
        Case("name-newline", lambda e: create(e, name="pvc-1\n"), Code.INVALID_ARGUMENT, ("name",), ""),
        Case("name-leading-dash", lambda e: create(e, name="-pvc"), Code.INVALID_ARGUMENT, ("'-pvc'",), ""),
        Case("name-too-long", lambda e: create(e, name="p" * 129), Code.INVALID_ARGUMENT, ("name", "128"), ""),
        Case("name-unicode", lambda e: create(e, name="pvc-\u00e9"), Code.INVALID_ARGUMENT, ("name",), ""),
    ]),
    ("bad-capabilities", [
        Case("no-capabilities", lambda e: create(e, volume_capabilities=[]), Code.INVALID_ARGUMENT,
             ("volume_capabilities",), ""),
        Case("no-access-type", lambda e: create(e, volume_capabilities=[cap_without_access_type()]),
             Code.INVALID_ARGUMENT, ("volume_capabilities[0]", "access_type"), ""),
        Case("no-access-mode", lambda e: create(e, volume_capabilities=[cap_without_access_mode()]),
             Code.INVALID_ARGUMENT, ("volume_capabilities[0]", "access_mode"), ""),
        Case("unknown-access-mode", lambda e: create(e, volume_capabilities=[cap_mode(Mode.UNKNOWN)]),
             Code.INVALID_ARGUMENT, ("access_mode",), ""),
        Case("second-capability-bad", lambda e: create(e, volume_capabilities=[cap(), cap_without_access_mode()]),
             Code.INVALID_ARGUMENT, ("volume_capabilities[1]",), ""),
        *[Case(f"mode-{m}", lambda e, m=m: create(e, volume_capabilities=[cap(), cap_mode(Mode.Mode.Value(m))]),
               Code.INVALID_ARGUMENT, (m,), "")
          for m in ("MULTI_NODE_READER_ONLY", "MULTI_NODE_SINGLE_WRITER", "MULTI_NODE_MULTI_WRITER")],
        Case("bad-fs-type", lambda e: create(e, volume_capabilities=[cap(fs_type="btrfs")]), Code.INVALID_ARGUMENT,
             ("'btrfs'",), ""),
        Case("flag-bind", lambda e: create(e, volume_capabilities=[cap(mount_flags=("bind",))]),
             Code.INVALID_ARGUMENT, ("'bind'",), ""),
        Case("flag-malformed", lambda e: create(e, volume_capabilities=[cap(mount_flags=("a;b",))]),
             Code.INVALID_ARGUMENT, ("'a;b'",), ""),
    ]),
    ("bad-parameters", [
        Case("unknown-parameter", lambda e: create(e, parameters={"fromat": "raw"}), Code.INVALID_ARGUMENT,
             ("'fromat'", "unknown StorageClass parameter"), ""),
        Case("unknown-parameter-case", lambda e: create(e, parameters={"Format": "raw"}), Code.INVALID_ARGUMENT,
             ("'Format'",), ""),
        Case("bad-format", lambda e: create(e, parameters={"format": "vmdk"}), Code.INVALID_ARGUMENT,
             ("'format'", "'vmdk'"), ""),
        Case("bad-preallocation", lambda e: create(e, parameters={"preallocation": "yes"}), Code.INVALID_ARGUMENT,
             ("'preallocation'", "'yes'"), ""),
        Case("bad-export", lambda e: create(e, parameters={"export": "nbd"}), Code.INVALID_ARGUMENT,
             ("'export'", "'nbd'"), ""),
        Case("bad-num-queues", lambda e: create(e, parameters={**VHOST, "numQueues": "0"}), Code.INVALID_ARGUMENT,
             ("'numQueues'",), ""),
        Case("num-queues-not-a-number", lambda e: create(e, parameters={**VHOST, "numQueues": "many"}),
             Code.INVALID_ARGUMENT, ("'numQueues'", "'many'"), ""),
        Case("bad-block-size", lambda e: create(e, parameters={**VHOST, "logicalBlockSize": "1024"}),
             Code.INVALID_ARGUMENT, ("'logicalBlockSize'",), ""),
        Case("bad-cache", lambda e: create(e, parameters={**VHOST, "cache": "none"}), Code.INVALID_ARGUMENT,
             ("'cache'", "'none'"), ""),
        Case("bad-discard", lambda e: create(e, parameters={"discard": "on"}), Code.INVALID_ARGUMENT,
             ("'discard'",), ""),
        Case("bad-detect-zeroes", lambda e: create(e, parameters={"detectZeroes": "yes"}), Code.INVALID_ARGUMENT,
             ("'detectZeroes'",), ""),
        Case("bad-poll", lambda e: create(e, parameters={**VHOST, "iothreadPollMaxNs": "-5"}), Code.INVALID_ARGUMENT,
             ("'iothreadPollMaxNs'",), ""),
        Case("vhost-key-on-filesystem", lambda e: create(e, parameters={"numQueues": "2"}), Code.INVALID_ARGUMENT,
             ("'numQueues'", "vhost-user-blk"), ""),
        Case("raw-metadata-preallocation", lambda e: create(e, parameters={"format": "raw", "preallocation": "metadata"}),
             Code.INVALID_ARGUMENT, ("'preallocation'",), ""),
    ]),
    Case("block-on-vhost", lambda e: create(e, parameters=VHOST, volume_capabilities=[cap(block=True)]),
         Code.INVALID_ARGUMENT, ("vhost-user-blk",), ""),
    ("impossible-capacity", [
        Case("required-over-limit", lambda e: create(e, capacity_range=sized(64 * MIB, 32 * MIB)), Code.OUT_OF_RANGE,
             ("required_bytes", str(64 * MIB), str(32 * MIB)), ""),
        Case("negative-required", lambda e: create(e, capacity_range=sized(-1)), Code.OUT_OF_RANGE, ("negative",), ""),
        Case("negative-limit", lambda e: create(e, capacity_range=sized(0, -MIB)), Code.OUT_OF_RANGE, ("negative",), ""),
        Case("limit-below-granularity", lambda e: create(e, capacity_range=sized(0, 4096)), Code.OUT_OF_RANGE,
             ("4096",), ""),
        Case("no-multiple-in-range", lambda e: create(e, capacity_range=sized(MIB + 1, 2 * MIB - 1)), Code.OUT_OF_RANGE,
             (str(MIB + 1), str(2 * MIB - 1)), ""),
    ]),
    Case("larger-than-pool", lambda e: create(e, capacity_range=sized(1 << 50)), Code.RESOURCE_EXHAUSTED,
         ("'pvc-new'", str(1 << 50), "free"), ""),
    Case("requisite-excludes-node", lambda e: create(e, accessibility_requirements=requisite("node-b")),
         Code.RESOURCE_EXHAUSTED, ("'pvc-new'", "'node-a'"), ""),
    Case("requisite-excludes-node-twice", lambda e: create(e, accessibility_requirements=requisite("node-b", "node-c")),
         Code.RESOURCE_EXHAUSTED, ("'node-a'",), ""),
)


@pytest.mark.parametrize("cases", CREATE_CASES)
async def test_create_volume(env: Env, cases: list[Case]) -> None:
    response = await run(env, cases, env.csi.controller.CreateVolume)
    if cases[0].code is not OK:
        assert await env.csi.list_volumes() == []  # nothing half-made is left behind
        assert not list((env.box.state_dir / "pool").glob("vol-*"))
    else:
        assert response.volume.accessible_topology[0].segments[TOPOLOGY_KEY] == "node-a"


async def test_create_volume_content_source(env: Env) -> None:
    """Pre-population from a source the driver does not offer is INVALID_ARGUMENT; a missing source NOT_FOUND."""
    caps = await env.csi.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
    offered = {c.rpc.type for c in caps.capabilities}
    RPC = pb.ControllerServiceCapability.RPC
    sources = [
        ("snapshot", pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(
            snapshot_id="snap-" + "0" * 24)), RPC.CREATE_DELETE_SNAPSHOT),
        ("volume", pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(volume_id=UNKNOWN_ID)),
         RPC.CLONE_VOLUME),
    ]
    for kind, source, capability_needed in sources:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.csi.controller.CreateVolume(create(env, volume_content_source=source))
        if capability_needed in offered:
            assert info.value.code() == Code.NOT_FOUND, (kind, info.value.details())
        else:
            assert info.value.code() == Code.INVALID_ARGUMENT, (kind, info.value.details())
            assert "volume_content_source" in (info.value.details() or "")


# DeleteVolume ----------------------------------------------------------------

DELETE_CASES = table(
    Case("baseline", lambda e: pb.DeleteVolumeRequest(volume_id=e.volume_id), OK),
    Case("empty-id", lambda e: pb.DeleteVolumeRequest(volume_id=""), Code.INVALID_ARGUMENT, ("volume_id",)),
    Case("while-staged", lambda e: pb.DeleteVolumeRequest(volume_id=e.volume_id), Code.FAILED_PRECONDITION,
         ("{volume_id}", "staged"), "staged"),
)


@pytest.mark.parametrize("cases", DELETE_CASES)
async def test_delete_volume(env: Env, cases: list[Case]) -> None:
    await run(env, cases, env.csi.controller.DeleteVolume)
    if cases[0].needs == "staged":  # refused: the volume and its data are all still there
        assert [v.volume_id for v in await env.csi.list_volumes()] == [env.volume_id]
        assert mounts.mounted_at(Path(env.staging)) is not None


# ValidateVolumeCapabilities --------------------------------------------------


def vvc(e: Env, **kw: Any) -> pb.ValidateVolumeCapabilitiesRequest:
    fields: dict[str, Any] = dict(volume_id=e.volume_id, volume_capabilities=[cap()])
    fields.update(kw)
    return pb.ValidateVolumeCapabilitiesRequest(**fields)


VALIDATE_CASES = table(
    Case("baseline", lambda e: vvc(e), OK),
    ("bad-ids", [
        Case("empty-id", lambda e: vvc(e, volume_id=""), Code.INVALID_ARGUMENT, ("volume_id",)),
        Case("unknown-id", lambda e: vvc(e, volume_id=UNKNOWN_ID), Code.NOT_FOUND, ("{unknown}",)),
        Case("malformed-id", lambda e: vvc(e, volume_id="pvc-123"), Code.NOT_FOUND, ("'pvc-123'",)),
    ]),
    ("bad-capabilities", [
        Case("no-capabilities", lambda e: vvc(e, volume_capabilities=[]), Code.INVALID_ARGUMENT,
             ("volume_capabilities",)),
        Case("no-access-mode", lambda e: vvc(e, volume_capabilities=[cap_without_access_mode()]),
             Code.INVALID_ARGUMENT, ("volume_capabilities[0]", "access_mode")),
        Case("no-access-type", lambda e: vvc(e, volume_capabilities=[cap_without_access_type()]),
             Code.INVALID_ARGUMENT, ("access_type",)),
        Case("flag-bind", lambda e: vvc(e, volume_capabilities=[cap(mount_flags=("bind",))]), Code.INVALID_ARGUMENT,
             ("'bind'",)),
    ]),
    ("bad-parameters", [
        Case("unknown-parameter", lambda e: vvc(e, parameters={"sise": "1"}), Code.INVALID_ARGUMENT, ("'sise'",)),
        Case("bad-parameter", lambda e: vvc(e, parameters={"format": "vmdk"}), Code.INVALID_ARGUMENT,
             ("'format'",)),
    ]),
)


@pytest.mark.parametrize("cases", VALIDATE_CASES)
async def test_validate_volume_capabilities(env: Env, cases: list[Case]) -> None:
    response = await run(env, cases, env.csi.controller.ValidateVolumeCapabilities)
    if cases[0].code is OK:
        assert response.HasField("confirmed") and not response.message


@pytest.mark.parametrize("kind, make, reason", [
    ("multi-node", lambda e: vvc(e, volume_capabilities=[cap(), cap_mode(Mode.MULTI_NODE_MULTI_WRITER)]),
     "MULTI_NODE_MULTI_WRITER"),
    ("fs-type", lambda e: vvc(e, volume_capabilities=[cap(fs_type="zfs")]), "'zfs'"),
    ("other-parameters", lambda e: vvc(e, parameters={"format": "raw"}), "parameters"),
    ("block-on-vhost", lambda e: vvc(e, volume_id=e.vhost_id, volume_capabilities=[cap(block=True)]),
     "vhost-user-blk"),
])
async def test_validate_volume_capabilities_unsupported_is_not_confirmed(
    env: Env, kind: str, make: Callable[[Env], Message], reason: str
) -> None:
    """The spec answers an unsupported capability with OK, no `confirmed` and a message saying why."""
    await env.prepare("vhost" if kind == "block-on-vhost" else "volume")
    response = await env.csi.controller.ValidateVolumeCapabilities(make(env))
    assert not response.HasField("confirmed")
    assert reason in response.message


# ListVolumes, GetCapacity, ControllerGetVolume -------------------------------

LIST_CASES = table(
    Case("baseline", lambda e: pb.ListVolumesRequest(max_entries=1), OK),
    ("bad-tokens", [
        Case("token-garbage", lambda e: pb.ListVolumesRequest(starting_token="garbage"), Code.ABORTED,
             ("starting_token", "'garbage'")),
        Case("token-almost-an-id", lambda e: pb.ListVolumesRequest(starting_token="vol-" + "g" * 24), Code.ABORTED,
             ("vol-" + "g" * 24,)),
        Case("token-with-newline", lambda e: pb.ListVolumesRequest(starting_token=e.volume_id + "\n"),
             Code.ABORTED, ("starting_token",)),
        Case("token-sql", lambda e: pb.ListVolumesRequest(starting_token="' OR 1=1 --"), Code.ABORTED,
             ("starting_token",)),
    ]),
    Case("negative-max-entries", lambda e: pb.ListVolumesRequest(max_entries=-1), Code.INVALID_ARGUMENT,
         ("max_entries",)),
)


@pytest.mark.parametrize("cases", LIST_CASES)
async def test_list_volumes(env: Env, cases: list[Case]) -> None:
    response = await run(env, cases, env.csi.controller.ListVolumes)
    if cases[0].code is OK:
        assert [entry.volume.volume_id for entry in response.entries] == [env.volume_id]


CAPACITY_CASES = table(
    Case("baseline", lambda e: pb.GetCapacityRequest(volume_capabilities=[cap()], parameters={"format": "raw"}), OK),
    ("bad-requests", [
        Case("unknown-parameter", lambda e: pb.GetCapacityRequest(parameters={"fromat": "raw"}),
             Code.INVALID_ARGUMENT, ("'fromat'",)),
        Case("bad-parameter", lambda e: pb.GetCapacityRequest(parameters={"export": "iscsi"}), Code.INVALID_ARGUMENT,
             ("'export'", "'iscsi'")),
        Case("no-access-type", lambda e: pb.GetCapacityRequest(volume_capabilities=[cap_without_access_type()]),
             Code.INVALID_ARGUMENT, ("volume_capabilities", "access_type")),
        Case("no-access-mode", lambda e: pb.GetCapacityRequest(volume_capabilities=[cap_without_access_mode()]),
             Code.INVALID_ARGUMENT, ("access_mode",)),
        Case("flag-bind", lambda e: pb.GetCapacityRequest(volume_capabilities=[cap(mount_flags=("bind",))]),
             Code.INVALID_ARGUMENT, ("'bind'",)),
    ]),
)


@pytest.mark.parametrize("cases", CAPACITY_CASES)
async def test_get_capacity(env: Env, cases: list[Case]) -> None:
    response = await run(env, cases, env.csi.controller.GetCapacity)
    if cases[0].code is OK:
        assert response.available_capacity > 0 and response.available_capacity % MIB == 0


@pytest.mark.parametrize("kind, request_", [
    ("other-node", pb.GetCapacityRequest(accessible_topology=pb.Topology(segments={TOPOLOGY_KEY: "node-b"}))),
    ("multi-node", pb.GetCapacityRequest(volume_capabilities=[cap_mode(Mode.MULTI_NODE_READER_ONLY)])),
    ("fs-type", pb.GetCapacityRequest(volume_capabilities=[cap(fs_type="ntfs")])),
    ("block-on-vhost", pb.GetCapacityRequest(parameters=VHOST, volume_capabilities=[cap(block=True)])),
])
async def test_get_capacity_is_zero_where_no_volume_could_be_made(
    env: Env, kind: str, request_: pb.GetCapacityRequest
) -> None:
    response = await env.csi.controller.GetCapacity(request_)
    assert response.available_capacity == 0


GET_CASES = table(
    Case("baseline", lambda e: pb.ControllerGetVolumeRequest(volume_id=e.volume_id), OK),
    ("bad-ids", [
        Case("empty-id", lambda e: pb.ControllerGetVolumeRequest(volume_id=""), Code.INVALID_ARGUMENT,
             ("volume_id",)),
        Case("unknown-id", lambda e: pb.ControllerGetVolumeRequest(volume_id=UNKNOWN_ID), Code.NOT_FOUND,
             ("{unknown}",)),
        Case("malformed-id", lambda e: pb.ControllerGetVolumeRequest(volume_id="../etc"), Code.NOT_FOUND,
             ("'../etc'",)),
        Case("id-with-newline", lambda e: pb.ControllerGetVolumeRequest(volume_id=e.volume_id + "\n"),
             Code.NOT_FOUND, ("{volume_id}",)),
    ]),
)


@pytest.mark.parametrize("cases", GET_CASES)
async def test_controller_get_volume(env: Env, cases: list[Case]) -> None:
    response = await run(env, cases, env.csi.controller.ControllerGetVolume)
    if cases[0].code is OK:
        assert response.volume.volume_id == env.volume_id and response.volume.capacity_bytes == 64 * MIB
        assert response.HasField("status")  # REQUIRED by the spec, even with nothing to report


# NodeStageVolume -------------------------------------------------------------

STAGE_CASES = table(
    Case("baseline", lambda e: stage(e), OK),
    ("bad-ids", [
        Case("empty-id", lambda e: stage(e, volume_id=""), Code.INVALID_ARGUMENT, ("volume_id",)),
        Case("unknown-id", lambda e: stage(e, volume_id=UNKNOWN_ID), Code.NOT_FOUND, ("{unknown}",)),
        Case("malformed-id", lambda e: stage(e, volume_id="vol-../../x"), Code.NOT_FOUND, ("'vol-../../x'",)),
    ]),
    ("bad-staging_target_path", path_cases("staging_target_path", stage)),
    ("bad-volume_capability", capability_cases("volume_capability", stage)),
    Case("block-on-vhost", lambda e: stage(e, volume_id=e.vhost_id, volume_capability=cap(block=True)),
         Code.INVALID_ARGUMENT, ("{vhost_id}", "vhost-user-blk"), "vhost"),
)


@pytest.mark.parametrize("cases", STAGE_CASES)
async def test_node_stage_volume(env: Env, cases: list[Case]) -> None:
    await run(env, cases, env.csi.node.NodeStageVolume)
    staged = [s.volume_id for s in await env.driver.catalog.stages()]
    assert staged == ([env.volume_id] if cases[0].code is OK else [])
    if cases[0].code is not OK:
        assert not list((env.box.kubelet / "plugins" / "staging").iterdir())  # nothing made, nothing mounted


# NodeUnstageVolume -----------------------------------------------------------

UNSTAGE_CASES = table(
    Case("baseline", lambda e: unstage(e), OK, needs="staged"),
    ("bad-ids", [
        Case("empty-id", lambda e: unstage(e, volume_id=""), Code.INVALID_ARGUMENT, ("volume_id",), "staged"),
        Case("unknown-id", lambda e: unstage(e, volume_id=UNKNOWN_ID), Code.NOT_FOUND, ("{unknown}",), "staged"),
        Case("malformed-id", lambda e: unstage(e, volume_id="x"), Code.NOT_FOUND, ("'x'",), "staged"),
    ]),
    ("bad-staging_target_path", path_cases("staging_target_path", unstage, needs="staged")),
)


@pytest.mark.parametrize("cases", UNSTAGE_CASES)
async def test_node_unstage_volume(env: Env, cases: list[Case]) -> None:
    await run(env, cases, env.csi.node.NodeUnstageVolume)
    assert (mounts.mounted_at(Path(env.staging)) is None) == (cases[0].code is OK)


# NodePublishVolume -----------------------------------------------------------

PUBLISH_CASES = table(
    Case("baseline", lambda e: publish(e), OK, needs="staged"),
    ("bad-ids", [
        Case("empty-id", lambda e: publish(e, volume_id=""), Code.INVALID_ARGUMENT, ("volume_id",), "staged"),
        Case("unknown-id", lambda e: publish(e, volume_id=UNKNOWN_ID), Code.NOT_FOUND, ("{unknown}",), "staged"),
        Case("malformed-id", lambda e: publish(e, volume_id="vol-1"), Code.NOT_FOUND, ("'vol-1'",), "staged"),
    ]),
    ("bad-target_path", path_cases("target_path", publish, needs="staged")),
    # The spec's NodePublishVolume table: no staging_target_path while STAGE_UNSTAGE_VOLUME is advertised
    # is FAILED_PRECONDITION (call NodeStageVolume first), not INVALID_ARGUMENT.
    ("bad-staging_target_path", path_cases("staging_target_path", publish, needs="staged",
                                           empty=Code.FAILED_PRECONDITION)),
    ("nested-paths", [
        Case("target-is-staging", lambda e: publish(e, target_path=e.staging), Code.INVALID_ARGUMENT,
             ("target_path", "staging_target_path"), "staged"),
        Case("target-inside-staging", lambda e: publish(e, target_path=e.staging + "/pod"), Code.INVALID_ARGUMENT,
             ("target_path", "{staging}/pod"), "staged"),
        Case("staging-inside-target", lambda e: publish(e, target_path=str(Path(e.staging).parent)),
             Code.INVALID_ARGUMENT, ("target_path", "staging_target_path"), "staged"),
    ]),
    ("bad-volume_capability", capability_cases("volume_capability", publish, needs="staged")),
    Case("before-stage", lambda e: publish(e), Code.FAILED_PRECONDITION,
         ("{volume_id}", "{staging}", "NodeStageVolume")),
    Case("other-staging-path", lambda e: publish(e, staging_target_path=e.staging + "2"), Code.FAILED_PRECONDITION,
         ("{volume_id}", "{staging}2"), "staged"),
    Case("block-of-mount-staged", lambda e: publish(e, volume_capability=cap(block=True)), Code.INVALID_ARGUMENT,
         ("{volume_id}",), "staged"),
)


@pytest.mark.parametrize("cases", PUBLISH_CASES)
async def test_node_publish_volume(env: Env, cases: list[Case]) -> None:
    await run(env, cases, env.csi.node.NodePublishVolume)
    target = Path(env.target)
    assert (mounts.mounted_at(target) is not None) == (cases[0].code is OK)
    if cases[0].code is not OK:
        assert not target.exists() and await env.driver.catalog.publishes() == []


# NodeUnpublishVolume ---------------------------------------------------------

UNPUBLISH_CASES = table(
    Case("baseline", lambda e: unpublish(e), OK),
    ("bad-ids", [
        Case("empty-id", lambda e: unpublish(e, volume_id=""), Code.INVALID_ARGUMENT, ("volume_id",)),
        Case("unknown-id", lambda e: unpublish(e, volume_id=UNKNOWN_ID), Code.NOT_FOUND, ("{unknown}",)),
        Case("malformed-id", lambda e: unpublish(e, volume_id="/etc/passwd"), Code.NOT_FOUND, ("'/etc/passwd'",)),
    ]),
    ("bad-target_path", path_cases("target_path", unpublish)),
)


@pytest.mark.parametrize("cases", UNPUBLISH_CASES)
async def test_node_unpublish_volume(env: Env, cases: list[Case]) -> None:
    await run(env, cases, env.csi.node.NodeUnpublishVolume)


# NodeGetVolumeStats ----------------------------------------------------------

STATS_CASES = table(
    Case("baseline", lambda e: stats(e), OK, needs="staged"),
    ("bad-ids", [
        Case("empty-id", lambda e: stats(e, volume_id=""), Code.INVALID_ARGUMENT, ("volume_id",), "staged"),
        Case("unknown-id", lambda e: stats(e, volume_id=UNKNOWN_ID), Code.NOT_FOUND, ("{unknown}",), "staged"),
        Case("malformed-id", lambda e: stats(e, volume_id="vol-"), Code.NOT_FOUND, ("'vol-'",), "staged"),
    ]),
    # The spec's NodeGetVolumeStats table: a volume_path the volume is not at is NOT_FOUND,
    # however malformed the path (csi-sanity asks with "some/path"); only a missing one is INVALID_ARGUMENT.
    ("bad-volume_path", path_cases("volume_path", stats, needs="staged", bad=Code.NOT_FOUND)),
    Case("not-staged", lambda e: stats(e), Code.NOT_FOUND, ("{volume_id}", "{staging}")),
    Case("other-path", lambda e: stats(e, volume_path=e.target), Code.NOT_FOUND, ("{volume_id}", "{target}"),
         "staged"),
)


@pytest.mark.parametrize("cases", STATS_CASES)
async def test_node_get_volume_stats(env: Env, cases: list[Case]) -> None:
    response = await run(env, cases, env.csi.node.NodeGetVolumeStats)
    if cases[0].code is OK:
        assert response.usage[0].total > 32 * MIB and not response.volume_condition.abnormal


# what the driver does not offer -----------------------------------------------

CONTROLLER_RPC = pb.ControllerServiceCapability.RPC
NODE_RPC = pb.NodeServiceCapability.RPC
NOT_OFFERED = [
    ("controller", "ControllerPublishVolume", pb.ControllerPublishVolumeRequest, CONTROLLER_RPC.PUBLISH_UNPUBLISH_VOLUME),
    ("controller", "ControllerUnpublishVolume", pb.ControllerUnpublishVolumeRequest,
     CONTROLLER_RPC.PUBLISH_UNPUBLISH_VOLUME),
    ("controller", "CreateSnapshot", pb.CreateSnapshotRequest, CONTROLLER_RPC.CREATE_DELETE_SNAPSHOT),
    ("controller", "DeleteSnapshot", pb.DeleteSnapshotRequest, CONTROLLER_RPC.CREATE_DELETE_SNAPSHOT),
    ("controller", "ListSnapshots", pb.ListSnapshotsRequest, CONTROLLER_RPC.LIST_SNAPSHOTS),
    ("controller", "GetSnapshot", pb.GetSnapshotRequest, CONTROLLER_RPC.GET_SNAPSHOT),
    ("controller", "ControllerExpandVolume", pb.ControllerExpandVolumeRequest, CONTROLLER_RPC.EXPAND_VOLUME),
    ("controller", "ControllerModifyVolume", pb.ControllerModifyVolumeRequest, CONTROLLER_RPC.MODIFY_VOLUME),
    ("node", "NodeExpandVolume", pb.NodeExpandVolumeRequest, NODE_RPC.EXPAND_VOLUME),
]


@pytest.mark.parametrize("service, method, request_type, capability_type", NOT_OFFERED,
                         ids=[m for _, m, _, _ in NOT_OFFERED])
async def test_unadvertised_rpcs_are_unimplemented(
    env: Env, service: str, method: str, request_type: type[Message], capability_type: int
) -> None:
    """An RPC whose capability is not advertised answers UNIMPLEMENTED; one that is advertised must not."""
    if service == "controller":
        caps = await env.csi.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
        stub: Any = env.csi.controller
    else:
        caps = await env.csi.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest())
        stub = env.csi.node
    advertised = capability_type in {c.rpc.type for c in caps.capabilities}
    request = request_type()
    if method == "ListSnapshots":
        request = pb.ListSnapshotsRequest(starting_token="garbage")  # so an implemented one fails too
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await getattr(stub, method)(request)
    if advertised:
        assert info.value.code() != Code.UNIMPLEMENTED, f"{method} is advertised but unimplemented"
    else:
        assert info.value.code() == Code.UNIMPLEMENTED, info.value.details()
        assert info.value.details()


# the driver's own directories inside the root ---------------------------------


async def test_paths_into_the_state_dir_are_refused_even_inside_the_root(box: Sandbox, tmp_path: Path) -> None:
    """With the target root above the state dir, the state dir, its contents and its parents are still off limits."""
    # The runtime directory may not lie under the target root (it holds keys for a moment): one of its own.
    async with in_process_driver(box, target_root=box.root, runtime_dir=tmp_path / "run") as (_, csi):
        volume = await csi.create_volume("pvc-in", 16 * MIB)
        for path in (box.state_dir, box.state_dir / "pool", box.state_dir / "exports" / volume.volume_id, box.root):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await csi.stage(volume.volume_id, str(path))
            assert info.value.code() == Code.INVALID_ARGUMENT
            assert str(path) in (info.value.details() or "")
        staging = box.root / "kubelet" / "staging"
        staging.mkdir()
        await csi.stage(volume.volume_id, str(staging))  # a sibling of the state dir is fine
        await csi.unstage(volume.volume_id, str(staging))


async def test_block_publish_through_a_dangling_symlink_creates_nothing_outside(env: Env) -> None:
    """A block publish touches and bind-mounts its target: through a dangling symlink that would land outside."""
    volume = await env.csi.create_volume("pvc-blk", 16 * MIB, block=True)
    staging = str(env.box.kubelet / "plugins" / "staging" / "blk")
    await env.csi.stage(volume.volume_id, staging, block=True)
    dangling = env.box.kubelet / "pods" / "p" / "dangling"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env.csi.publish(volume.volume_id, staging, str(dangling), block=True)
    assert info.value.code() == Code.INVALID_ARGUMENT and "resolves to" in (info.value.details() or "")
    assert not os.path.lexists(env.outside / "nothere-either") and dangling.is_symlink()
    await env.csi.unstage(volume.volume_id, staging)


async def test_publish_under_a_missing_parent_names_it(env: Env) -> None:
    """The CO creates the target's parent (CSI spec); if it did not, say so instead of INTERNAL."""
    await env.prepare("staged")
    target = env.box.kubelet / "pods" / "never-made" / "volume"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env.csi.publish(env.volume_id, env.staging, str(target))
    assert info.value.code() in (Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT), info.value.details()
    assert str(target.parent) in (info.value.details() or "")
