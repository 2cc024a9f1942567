"""A node's own mount, PID, network and UTS namespaces, its cgroup, and the processes started in them.

Everything a node runs (etcd, the control plane, containerd, kubelet, and so
every pod) is started with `nsenter` into the namespaces of one holder
process, inside one cgroup nested under the test's own. The holder is PID 1
of the node's PID namespace, so a host-PID pod that enters `/proc/1/ns/mnt`
(as the Kubernetes e2e suite's host-exec pods do) lands in the node, as it
would on a real one. So every mount
kubelet and the driver make lives in the node's mount namespace (shared
propagation there, private towards the host), and teardown finds every
process by its cgroup: when they are gone the namespace goes with them, and
no mount, process or address is left on the host.

Inside, the node sees a tmpfs on /run and /var/lib (nothing of the host's),
the run's own directories bound on /var/lib/kubelet, /var/lib/csi-qsd and
/var/log, and fixed values for the kernel settings kubelet would otherwise
write host-wide.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from testing import owner

# Kernel settings kubelet sets at start when they differ (cm.setupKernelTunables). They are not
# per namespace: kubelet would change the host's. The node sees files holding the values kubelet
# wants, bound over the real ones in its own mount namespace.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}


def _self_cgroup_parent() -> str:
    """The memory cgroup this test runs in: the node's cgroup nests under it in every hierarchy."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path.rstrip("/")
    return ""


def cgroup_hierarchies(*, unified: bool = False) -> list[Path]:
    """The cgroup v1 hierarchies mounted under /sys/fs/cgroup, and cgroup2's `unified` if asked."""
    found = []
    for entry in sorted(Path("/sys/fs/cgroup").iterdir()):
        if (unified or entry.name != "unified") and (entry / "cgroup.procs").exists():
            found.append(entry)
    return found


def cgroup_pids(cgroup: str) -> set[int]:
    """Every process in `cgroup` (a path from the hierarchies' roots) and below, pods included."""
    pids: set[int] = set()
    for hierarchy in cgroup_hierarchies(unified=True):
        if hierarchy.name not in ("pids", "unified"):
            continue
        root = hierarchy / cgroup.lstrip("/")
        if root.exists():
            for procs in root.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in procs.read_text().split())
    return pids


def kill_cgroup(cgroup: str, also: Callable[[], set[int]] = set) -> bool:
    """SIGKILL everything in `cgroup` (and what `also` names) until nothing is left; False if something stays."""
    for _ in range(50):
        pids = cgroup_pids(cgroup) | also()
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    return False


def remove_cgroup(cgroup: str, made: list[Path] | None = None) -> list[str]:
    """rmdir `cgroup` and everything below it in every hierarchy (kubelet and runc make cgroups in cgroup2's
    too), then the parents `made` for it; what could not be removed."""
    problems = []
    trees = [h / cgroup.lstrip("/") for h in cgroup_hierarchies(unified=True)]
    for directory in [*trees, *reversed(made or [])]:
        if not directory.exists():
            continue
        children = sorted((d for d in directory.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts))
        for child in [*children, directory]:
            if not _rmdir(child):
                problems.append(f"cgroup {child} not removed")
    return problems


@dataclass(frozen=True)
class NodeAddress:
    """The node's link: a veth pair whose host end `host_if` is a port of the host's bridge `bridge`.

    Nodes on one bridge reach each other and the host (`host_ip`, the bridge's own address) without
    the host routing anything.
    """

    host_if: str
    bridge: str
    host_ip: str
    node_ip: str
    prefix: int = 24


def add_bridge(address: NodeAddress) -> None:
    """The host's bridge for the cluster's nodes, with the host's address on it (made once)."""
    if subprocess.run(["ip", "link", "show", address.bridge], capture_output=True).returncode == 0:
        return
    subprocess.run(["ip", "link", "add", address.bridge, "type", "bridge"], check=True)
    subprocess.run(["ip", "addr", "add", f"{address.host_ip}/{address.prefix}", "dev", address.bridge], check=True)
    subprocess.run(["ip", "link", "set", address.bridge, "up"], check=True)


def remove_bridge(address: NodeAddress) -> None:
    subprocess.run(["ip", "link", "del", address.bridge], capture_output=True)


class NodeNamespace:
    """One node's namespaces and cgroup; `start` makes them, `stop` removes everything in them."""

    def __init__(self, name: str, base: Path, address: NodeAddress) -> None:
        self.name = name
        self.base = base
        self.address = address
        # Its run's in the name: a run killed before its teardown leaves a cgroup no later run takes for its own
        # (testing.stale_runs sweeps it, found by the record in `base`).
        self.cgroup = f"{_self_cgroup_parent()}/{name}-{owner.owner_token()}"
        self.holder: subprocess.Popen[bytes] | None = None
        self._init_pid = 0
        self._made_cgroups: list[Path] = []
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    @property
    def pid(self) -> int:
        """The host's PID of the node's PID 1, whose namespaces every node process enters."""
        assert self._init_pid, "the node namespace is not started"
        return self._init_pid

    def _make_cgroup(self) -> None:
        for hierarchy in cgroup_hierarchies():
            path = hierarchy / self.cgroup.lstrip("/")
            missing = [p for p in [path, *path.parents] if hierarchy in p.parents and not p.exists()]
            for directory in reversed(missing):
                directory.mkdir()
                self._made_cgroups.append(directory)
                if hierarchy.name == "cpuset":  # a new cpuset takes no task before it has cpus and mems
                    for knob in ("cpuset.cpus", "cpuset.mems"):
                        (directory / knob).write_text((directory.parent / knob).read_text())

    def _kill_all(self) -> bool:
        """SIGKILL everything in the node's cgroup (and the holder) until nothing is left; False if it stays."""
        holder = self.holder
        return kill_cgroup(self.cgroup, lambda: {holder.pid} if holder is not None and holder.poll() is None else set())

    def _join_cgroup(self, pid: int = 0) -> None:
        """Move `pid` (0: the calling process) into the node's cgroup; what it starts follows it."""
        for hierarchy in cgroup_hierarchies():
            (hierarchy / self.cgroup.lstrip("/") / "cgroup.procs").write_text(str(pid))

    def start(self) -> None:
        """Make the namespaces, the cgroup, the veth link (the bridge must exist) and the node's view of /run, /var/lib and /var/log."""
        for sub in ("kubelet", "csi-qsd", "log", "sysctl"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        self._make_cgroup()
        owner.record_cgroup(self.base, self.cgroup)
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--net", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc",
             "--propagation", "private", "sleep", "infinity"],
            stdin=subprocess.DEVNULL, start_new_session=True)
        self._join_cgroup(self.holder.pid)
        holder = self.holder.pid

        def init_started() -> bool:
            children = _children(holder)
            self._init_pid = children[0] if children else 0
            return bool(self._init_pid) and os.readlink(f"/proc/{self._init_pid}/ns/pid") != os.readlink(
                "/proc/self/ns/pid") and Path(f"/proc/{self._init_pid}/comm").read_text().strip() == "sleep"

        wait_for(init_started, 10, "the node's PID 1")
        a = self.address
        # A run killed before its teardown (SIGKILL, a CI timeout) leaves its host end behind.
        subprocess.run(["ip", "link", "del", a.host_if], capture_output=True)
        subprocess.run(["ip", "link", "add", a.host_if, "type", "veth", "peer", "name", "eth0",
                        "netns", f"/proc/{self.pid}/ns/net"], check=True)
        subprocess.run(["ip", "link", "set", a.host_if, "master", a.bridge, "up"], check=True)
        binds = []
        for key, value in KUBELET_SYSCTLS.items():
            fake = self.base / "sysctl" / key.replace("/", "_")
            fake.write_text(value + "\n")
            binds.append(f"mount --bind {fake} /proc/sys/{key}")
        script = "\n".join([
            "set -e",
            f"hostname {self.name}",
            "mount --make-rshared /",
            "mount -t tmpfs -o mode=755 node-run /run",
            "mount -t tmpfs -o mode=755 node-var-lib /var/lib",
            "mkdir -p /var/lib/kubelet /var/lib/csi-qsd",
            f"mount --bind {self.base / 'kubelet'} /var/lib/kubelet",
            f"mount --bind {self.base / 'csi-qsd'} /var/lib/csi-qsd",
            f"mount --bind {self.base / 'log'} /var/log",
            *binds,
            "ip link set lo up",
            f"ip addr add {a.node_ip}/{a.prefix} dev eth0",
            "ip link set eth0 up",
        ])
        self.run(["sh", "-c", script])

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the node's namespaces."""
        return ["nsenter", "-t", str(self.pid), "-m", "-n", "-u", "-p", "--", *argv]

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `argv` in the node and wait; its output is returned (and in the error if it fails)."""
        result = subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout,
                                input=input, env={**os.environ, "LC_ALL": "C"})
        if check and result.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} exited {result.returncode}: "
                               f"{result.stderr.strip() or result.stdout.strip()}")
        return result

    def spawn(self, label: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start a long-running node process, its output in `log`."""
        out: IO[bytes] = open(log, "ab")
        try:
            # Joined before exec, so that teardown finds it, and everything it starts, by the node's cgroup.
            proc = subprocess.Popen(self.command(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "LC_ALL": "C", **(env or {})}, start_new_session=True,
                                    preexec_fn=self._join_cgroup)
        finally:
            out.close()
        self.processes.append((label, proc))
        return proc

    def check_alive(self) -> None:
        """Raise naming any node process that exited."""
        dead = [f"{label} (exit {p.returncode})" for label, p in self.processes if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{self.name}: exited: {', '.join(dead)}")

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
        """Signal the node program `proc` runs: nsenter forks it into the PID namespace and forwards nothing."""
        for pid in _children(proc.pid) or [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def cgroup_pids(self) -> set[int]:
        """Every process in the node's cgroup and below (pods included)."""
        return cgroup_pids(self.cgroup)

    def stop_process(self, label: str, timeout: float = 15) -> None:
        """SIGTERM the named node processes, SIGKILL after `timeout`."""
        for name, proc in self.processes:
            if name == label and proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)

    def stop(self) -> list[str]:
        """Kill everything in the node, remove its cgroup and link; return what could not be removed."""
        problems: list[str] = []
        for label, proc in reversed(self.processes):
            if proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for label, proc in reversed(self.processes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        if not self._kill_all():
            problems.append(f"processes still in the node's cgroup: {sorted(self.cgroup_pids())}")
        for _, proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        if self.holder is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.holder.wait(5)
        subprocess.run(["ip", "link", "del", self.address.host_if], capture_output=True)
        return problems + remove_cgroup(self.cgroup, self._made_cgroups)


def _children(pid: int) -> list[int]:
    """The host's PIDs of `pid`'s children."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rmdir(directory: Path) -> bool:
    """Remove an empty cgroup, retrying while the kernel still counts its last processes."""
    for _ in range(50):
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return False


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` until true; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if condition():
                return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
