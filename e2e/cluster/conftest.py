"""The cluster tier's fixtures: one cluster per session with the driver deployed, torn down leaving nothing.

The cluster is built (or found in the cache), started, given the snapshot
CRDs and controller, and csi-qsd is deployed with `kubectl apply -k` of the
overlay. At the end every test namespace is deleted first, so the driver
unpublishes, unstages and deletes what the tests made as it would in a real
cluster; what it leaves fails the session: a PersistentVolume or a
VolumeSnapshotContent (a retained snapshot), a volume or snapshot still in a
node's catalog (asked over CSI: ListVolumes, ListSnapshots), a QSD export:
FUSE (a mount) or on a UNIX socket (vhost-user-blk, NBD: a socket QSD listens
on, other than its monitor's), a pod's mount, a loop device over a node's
FUSE exports. QSD's monitor cannot be asked for its exports: it takes one
client, and the driver holds it. Then the nodes are killed and their cgroups
and links removed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from csi_qsd.cli.client import CSIClient
from testing import owner, tiers
from testing.cluster import deploy, examples, outcomes, prebuilt, session
from testing.cluster.build import Built, build_all, cache_root
from testing.cluster.cluster import Binaries, Cluster
from testing.cluster.versions import KUBERNETES

TOOLS = ("go", "gcc", "containerd", "runc", "podman", "mmdebstrap", "iptables", "nsenter", "unshare")
_MISSING = [tool for tool in TOOLS if shutil.which(tool) is None] + prebuilt.missing()
_REPORT: list[str] = []


def cluster_marks() -> list[pytest.MarkDecorator]:
    """`pytestmark` for a cluster-tier module: marked; a missing tool fails it in CI, else skips it, naming the tool."""
    return [pytest.mark.cluster, tiers.needs("cluster", _MISSING)]


# Package scope: the cluster goes when the tier's last test is done, not at the end of the whole suite
# (the e2e tests after it boot guests and want the cores).
@pytest.fixture(scope="package")
def built() -> Built:
    return build_all()


@pytest.fixture(scope="package")
def cluster(built: Built) -> Iterator[Cluster]:
    base = owner.make_base("csi-qsd-cluster-", Path("/var/tmp"))
    running = Cluster(base, Binaries(built.kubernetes))
    problems: list[str] = []
    try:
        session.start_deployed(running, built)
        versions = json.loads(running.kubectl("version", "-o", "json").stdout)
        _REPORT.append(f"cluster tier: Kubernetes {versions['serverVersion']['gitVersion']} (server), "
                       f"{versions['clientVersion']['gitVersion']} (kubectl), built as {KUBERNETES}; "
                       f"containerd {_containerd_version()}")
        _report_sidecars(running, built)
        yield running
    finally:
        try:
            problems += _graceful_teardown(running)
        finally:
            problems += running.stop()
            kept = _keep_logs(base)
            if problems:
                _REPORT.append("cluster teardown left: " + "; ".join(problems))
            _REPORT.append(f"cluster logs (components and pods) kept in {kept}")
    assert not problems, f"the cluster left things behind: {problems} (logs in {kept})"


def _report_sidecars(cluster: Cluster, built: Built) -> None:
    """Say which registrar and livenessprobe the node pod runs: the release, and whether its process is that file."""
    pod = deploy.driver_pod(cluster)
    for release in built.releases:
        digest = deploy.executable_digest(cluster, pod, release.sidecar.container)
        verdict = "its process runs that file" if digest == release.sha256 else f"but its process runs sha256:{digest}"
        _REPORT.append(f"cluster tier ran {release.describe()}; {verdict}")


def _keep_logs(base: Path) -> Path:
    """Move the run's logs to the cache (replacing the previous run's) and remove the rest of `base`."""
    kept = cache_root() / "last-run-logs"
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    sources = [("components", base / "logs"), ("pods", base / "node" / "log" / "pods")]
    sources += [(f"pods-{extra.name}", extra / "node" / "log" / "pods") for extra in sorted(base.glob("node-*"))]
    for name, source in sources:
        if source.exists():
            shutil.copytree(source, kept / name, symlinks=True, dirs_exist_ok=True)
    shutil.rmtree(base, ignore_errors=True)
    return kept


def _containerd_version() -> str:
    return subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout.split()[-2:][0]


def _graceful_teardown(cluster: Cluster) -> list[str]:
    """Delete the tests' namespaces and wait until the driver has taken every volume down."""
    if not session.alive(cluster):
        return []
    namespaces = [n["metadata"]["name"] for n in deploy.get_json(cluster, "namespaces", "-l", "csi-qsd-test=true")["items"]]
    problems = session.release_volumes(cluster, namespaces, delete_namespaces=True)
    try:
        deploy.wait_until(lambda: _nothing_held(cluster), 120,
                          "no VolumeSnapshotContent, no volume or snapshot in a catalog, no export in a QSD")
    except TimeoutError as error:  # its message ends with the last check's answer: what is still held
        problems.append(str(error))
    return problems + session.volume_leftovers(cluster)


def _nothing_held(cluster: Cluster) -> bool:
    """True when the driver holds nothing (`_driver_leftovers`); raises naming what it still holds."""
    left = _driver_leftovers(cluster)
    if left:
        raise AssertionError("; ".join(left))
    return True


def _driver_leftovers(cluster: Cluster) -> list[str]:
    """What the driver still holds once every claim is gone: VolumeSnapshotContents, each node's catalog (volumes and
    snapshots, over the node's CSI socket) and the UNIX sockets its QSD exports on (vhost-user-blk, NBD)."""
    left = [f"VolumeSnapshotContent {c['metadata']['name']} (deletionPolicy {c['spec'].get('deletionPolicy')})"
            for c in deploy.get_json(cluster, "volumesnapshotcontents")["items"]]
    for node in cluster.nodes:
        left += asyncio.run(_catalog_leftovers(node.name, node.namespace.base))
        sockets = _qsd_sockets(node.namespace.cgroup_pids())
        if not any(path.endswith("/qmp.sock") for path in sockets):  # else the listing is not QSD's: nothing checked
            left.append(f"{node.name}: no QSD monitor socket found, so its exports could not be listed")
        left += [f"{node.name}: QSD export socket {path}" for path in sockets if not path.endswith("/qmp.sock")]
    return left


def _qsd_sockets(pids: set[int]) -> list[str]:
    """The UNIX sockets the QSDs among `pids` listen on, listed by `ss` in each one's network namespace (the pod's)."""
    paths = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "qemu-storage-da":  # the kernel's 15 characters
                continue
        except OSError:
            continue
        listed = subprocess.run(["nsenter", "-t", str(pid), "-n", "ss", "-xlpH"], capture_output=True, text=True,
                                env={"LC_ALL": "C", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}).stdout
        paths += [line.split()[4] for line in listed.splitlines() if f"pid={pid}," in line]
    return paths


async def _catalog_leftovers(name: str, root: Path) -> list[str]:
    """`root`: the node's directory, bound on its /var/lib/kubelet (`kubelet`): the driver's socket is there."""
    async with CSIClient(f"unix://{root / 'kubelet' / 'plugins' / 'csi-qsd.io' / 'csi.sock'}", timeout=30) as csi:
        left = [f"{name}: volume {v.volume_id} in the catalog" for v in await csi.list_volumes()]
        return left + [f"{name}: snapshot {s.snapshot_id} in the catalog" for s in await csi.list_snapshots()]


@pytest.fixture
def test_namespace(cluster: Cluster) -> Iterator[str]:
    """A namespace of the test's own, deleted (with its PVCs and pods) afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, "csi-qsd-test=true")
    deploy.wait_until(lambda: cluster.kubectl("get", "-n", name, "serviceaccount", "default", check=False).returncode == 0,
                      60, f"the default service account in {name}")
    yield name
    # The examples' pods run `sleep` as PID 1, which ignores SIGTERM: without a short grace period each
    # would hold the namespace for the default 30 s.
    cluster.kubectl("delete", "-n", name, "pods", "--all", "--grace-period=1", "--wait=true", "--timeout=120s",
                    check=False, timeout=150)
    cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=180s", check=False, timeout=200)
    examples.delete_owned(cluster, name)  # what the test applied outside it: StorageClasses, RBAC, VolumeAttributesClasses


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{outcomes.LAST}: runs after every other cluster test (it checks what they did)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `cluster_tier_last` move behind the tier's last test (still inside the package: same cluster)."""
    outcomes.move_last(items, Path(__file__).parent)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcomes.record(report.nodeid, report.when, report.outcome)


def report(line: str) -> None:
    """A line for the session's summary (printed after the results)."""
    _REPORT.append(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _REPORT:
        terminalreporter.write_line(line)


