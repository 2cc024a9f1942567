"""`scripts/cluster.sh up | down | status | example`: the cluster tier's one-node cluster, left running to try csi-qsd.

`up` builds what the tier builds (or finds it in the cache), then starts a
keeper: a process in a session of its own that brings the cluster up as the
tier's session does (`session.start_deployed`: snapshot support, then
`kubectl apply -k` of deploy/ plus testing/cluster/overlay), says it is ready,
and holds it until `down` sends it SIGTERM. The keeper then releases every
volume (deletes the pods, claims and snapshots outside the cluster's own
namespaces and waits for the driver to delete every PersistentVolume),
stops the node (every process in its cgroup, the cgroups, the link, the
bridge) and writes down what it could not remove. `down` prints that and
checks the host itself: no process, cgroup, link, mount or loop device of
the cluster left. A keeper that died without a teardown (SIGKILL, a
reboot) is cleaned up after by `down` from what `up` recorded.

Only one cluster runs on a host at a time (the bridge and the node names
are fixed): `up` refuses while one runs, the tier's or another `up`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from csi_qsd.sys import loop_ioctl
from testing.cluster import build, examples, namespace, session, versions
from testing.cluster.build import QEMU_IMAGE, Built
from testing.cluster.cluster import BRIDGE, Binaries, Cluster, node_spec

DEFAULT_DIR = Path("/var/tmp/csi-qsd-try")
# What the first build takes: Kubernetes, etcd, the sidecars and Helm from source, the images (README, "Try it").
FIRST_BUILD = "tens of minutes on 2 cores"
START_TIMEOUT = 900.0
STOP_TIMEOUT = 600.0


def state_dir() -> Path:
    explicit = os.environ.get("CSI_QSD_TRY_DIR")
    return Path(explicit) if explicit else DEFAULT_DIR


class _Files:
    """The keeper's files in the state directory; the cluster's own (kubeconfig, logs, nodes) are under it too."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.pid = base / "keeper.pid"
        self.log = base / "keeper.log"
        self.ready = base / "ready.json"
        self.failed = base / "failed.txt"
        self.result = base / "down.json"
        self.bin = base / "bin"
        self.kubeconfig = base / "admin.kubeconfig"

    def keeper_pid(self) -> int:
        """The keeper's PID while it runs, else 0."""
        try:
            pid = int(self.pid.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return 0
        return pid if b"testing.cluster.up" in cmdline and b"keep" in cmdline else 0


# -- the keeper ---------------------------------------------------------------------------------


class _Stop(Exception):
    """SIGTERM or SIGINT reached the keeper."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _record(running: Cluster) -> dict[str, Any]:
    """What `down` needs to clean up after a keeper that died: each node's cgroup and link, the bridge."""
    return {"nodes": [{"name": n.name, "cgroup": n.namespace.cgroup} for n in running.nodes],
            "kubeconfig": str(running.admin_kubeconfig)}


def keep(base: Path) -> int:
    """Bring the cluster up, say so in `ready.json`, hold it until SIGTERM, then take everything down."""
    files = _Files(base)
    files.pid.write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    built = build.build_all()
    running = Cluster(base, Binaries(built.kubernetes))
    problems: list[str] = []
    loops: list[str] = []
    try:
        started = time.monotonic()
        print(f"starting the cluster in {base}", flush=True)
        (base / "record.json").write_text(json.dumps(_record(running)))
        session.start_deployed(running, built)
        _link_tools(files, built)
        files.ready.write_text(json.dumps({**_record(running), "seconds": round(time.monotonic() - started)}))
        print(f"ready after {time.monotonic() - started:.0f} s", flush=True)
        while True:
            signal.pause()
    except _Stop as stop:
        print(f"{stop}: taking the cluster down", flush=True)
    except BaseException:
        files.failed.write_text(traceback.format_exc())
        print(traceback.format_exc(), flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if session.alive(running):
                problems += session.release_volumes(running, session.user_namespaces(running), delete_namespaces=False)
                problems += session.volume_leftovers(running)
                loops = [str(d) for node in running.nodes for d in node.loop_devices()]
        except Exception as error:  # the teardown goes on: the node must be stopped whatever the API says
            problems.append(f"releasing the volumes failed: {error!r}")
        problems += running.stop()
        files.result.write_text(json.dumps({"problems": problems, "loops": loops, **_record(running)}))
        print(f"stopped; left: {problems or 'nothing'}", flush=True)
    return 0


def _link_tools(files: _Files, built: Built) -> None:
    """kubectl (and helm, when built) of the cluster's versions in one directory for the user's PATH."""
    files.bin.mkdir(exist_ok=True)
    tools = {"kubectl": built.kubernetes / "kubectl"}
    if built.helm is not None:
        tools["helm"] = built.helm
    for name, target in tools.items():
        link = files.bin / name
        link.unlink(missing_ok=True)
        link.symlink_to(target)


# -- up -------------------------------------------------------------------------------------------


def up(base: Path) -> int:
    files = _Files(base)
    if files.keeper_pid():
        print(f"csi-qsd's cluster is already up (keeper pid {files.keeper_pid()}).")
        _next_steps(files)
        return 0
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        print(f"error: another cluster runs on this host (its bridge {BRIDGE} exists): the cluster tier's, or one "
              f"whose state is not in {base}; stop it first", file=sys.stderr)
        return 1
    if base.exists():
        if files.ready.exists() and not files.result.exists():
            print(f"error: {base} holds a cluster whose keeper is gone: run `scripts/cluster.sh down` first",
                  file=sys.stderr)
            return 1
        shutil.rmtree(base)
    base.mkdir(parents=True)
    if not (build.cache_root() / f"kubernetes-{versions.KUBERNETES}").exists():
        print(f"building Kubernetes, etcd, the CSI sidecars, Helm and the images into {build.cache_root()} "
              f"(first run: {FIRST_BUILD}; later runs reuse it)", flush=True)
    else:
        print(f"building what is missing from {build.cache_root()}", flush=True)
    started = time.monotonic()
    build.build_all()
    print(f"built (or found in the cache) in {time.monotonic() - started:.0f} s; starting the cluster "
          f"(log: {files.log})", flush=True)
    with open(files.log, "ab") as log:
        keeper = subprocess.Popen([sys.executable, "-m", "testing.cluster.up", "keep", str(base)],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=build.REPO)
    deadline = time.monotonic() + START_TIMEOUT
    while not files.ready.exists():
        if keeper.poll() is not None or time.monotonic() > deadline:
            if keeper.poll() is None:
                keeper.send_signal(signal.SIGTERM)
                keeper.wait(STOP_TIMEOUT)
            failure = files.failed.read_text() if files.failed.exists() else "(no error recorded)"
            print(f"error: the cluster did not come up; it was taken down again. Log: {files.log}; the "
                  f"components' logs: {base / 'logs'}\n{failure[-3000:]}", file=sys.stderr)
            return 1
        time.sleep(1)
    ready = json.loads(files.ready.read_text())
    print(f"csi-qsd's cluster is up: Kubernetes {versions.KUBERNETES}, one node, started and deployed in "
          f"{ready['seconds']} s.")
    _next_steps(files)
    return 0


def _next_steps(files: _Files) -> None:
    print(f"""
  export KUBECONFIG={files.kubeconfig} PATH={files.bin}:$PATH

  kubectl -n csi-qsd get pods                              # the node plugin, QSD and the sidecars
  kubectl apply -f deploy/examples/filesystem-pod.yaml     # a claim of class csi-qsd-fs and a pod writing to it
  kubectl get pvc csi-qsd-fs-demo -w                       # Pending until the pod is scheduled, then Bound
  kubectl exec -it csi-qsd-fs-demo -- sh                   # the ext4 volume is at /data
  scripts/cluster.sh example qemu-vhost-user-blk.yaml | kubectl apply -f -   # a QEMU VM on a csi-qsd-vm disk
  kubectl attach -it csi-qsd-qemu-demo                     # its serial console (Ctrl-a x quits QEMU)

  scripts/cluster.sh down                                  # delete the volumes, stop everything, check nothing is left
""")


# -- down -----------------------------------------------------------------------------------------


def down(base: Path) -> int:
    files = _Files(base)
    if not base.exists():
        print(f"no cluster recorded in {base}: nothing to take down")
        return 0
    pid = files.keeper_pid()
    started = time.monotonic()
    if pid:
        print(f"deleting every pod, claim and snapshot outside the cluster's namespaces, waiting for the driver "
              f"to delete their volumes, then stopping the cluster (keeper pid {pid})", flush=True)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while files.keeper_pid() and time.monotonic() < deadline:
            time.sleep(0.5)
        if files.keeper_pid():
            print(f"error: the keeper (pid {pid}) did not stop in {STOP_TIMEOUT:.0f} s; log: {files.log}",
                  file=sys.stderr)
            return 1
    problems: list[str] = []
    if files.result.exists():
        result = json.loads(files.result.read_text())
        problems += result["problems"]
        loops = result["loops"]
    else:
        print("the keeper is gone without a teardown: stopping what it recorded", flush=True)
        problems += _stop_recorded(base)
        loops = []
    problems += leftovers(base, loops)
    if problems:
        print(f"error: the cluster left: {'; '.join(problems)}\nlogs kept in {base}", file=sys.stderr)
        return 1
    shutil.rmtree(base)
    print(f"down in {time.monotonic() - started:.0f} s: no process, cgroup, link, mount or loop device of the "
          "cluster is left")
    return 0


def _recorded_nodes(base: Path) -> list[dict[str, str]]:
    record = base / "record.json"
    return list(json.loads(record.read_text())["nodes"]) if record.exists() else []


def _stop_recorded(base: Path) -> list[str]:
    """Kill what is in each recorded node's cgroup and remove the cgroups, links and the bridge."""
    problems: list[str] = []
    for index, node in enumerate(_recorded_nodes(base)):
        spec = node_spec(index)
        node_namespace = namespace.NodeNamespace(node["name"], base, spec.address)
        node_namespace.cgroup = node["cgroup"]
        problems += node_namespace.stop()
    namespace.remove_bridge(node_spec(0).address)
    return problems


def processes_naming(base: Path) -> list[int]:
    """The processes (but this one) whose command line holds `base`: the cluster's, its files being there."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(base).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
    return found


def leftovers(base: Path, loops: list[str]) -> list[str]:
    """What of the cluster is still on the host: processes and mounts naming `base`, the nodes' cgroups, the
    links and the bridge, and any of `loops` still attached."""
    found = [f"process {pid}" for pid in processes_naming(base)]
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if str(base) in line:
            found.append(f"mount {line.split()[4]}")
    for node in _recorded_nodes(base):
        for hierarchy in namespace.cgroup_hierarchies(unified=True):
            if (hierarchy / node["cgroup"].lstrip("/")).exists():
                found.append(f"cgroup {hierarchy / node['cgroup'].lstrip('/')}")
    for index in range(len(_recorded_nodes(base))):
        link = node_spec(index).address.host_if
        if subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
            found.append(f"link {link}")
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        found.append(f"bridge {BRIDGE}")
    found += [f"loop device {d}" for d in loops if loop_ioctl.backing_identity(Path(d)) is not None]
    return found


# -- status and examples --------------------------------------------------------------------------


def status(base: Path) -> int:
    files = _Files(base)
    if files.keeper_pid() and files.ready.exists():
        print(f"up (keeper pid {files.keeper_pid()})")
        _next_steps(files)
        return 0
    print("starting" if files.keeper_pid() else "down")
    return 0 if files.keeper_pid() else 3


def local_example(name: str) -> list[dict[str, Any]]:
    """deploy/examples/`name` with what this cluster lacks replaced: the QEMU example gets the QEMU image built
    here (the shipped one installs QEMU at start, which needs egress) and TCG instead of KVM (no device plugin
    serves devices.kubevirt.io/kvm here). Every other example is as shipped."""
    docs = examples.example(name)
    for doc in docs:
        if doc["kind"] != "Pod":
            continue
        for container in doc["spec"]["containers"]:
            script = " ".join(container.get("args") or [])
            if "qemu-system-x86_64" not in script:
                continue
            command = re.sub(r"^.*?exec qemu-system-x86_64", "exec qemu-system-x86_64", script)
            command = command.replace("accel=kvm", "accel=tcg").replace("-cpu host", "-cpu max")
            container.update({"image": QEMU_IMAGE, "imagePullPolicy": "Never", "command": ["/bin/sh", "-c"],
                              "args": [command]})
            limits = container.get("resources", {}).get("limits", {})
            limits.pop("devices.kubevirt.io/kvm", None)
    return docs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster.sh", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="build (or reuse the cache), start the cluster, deploy csi-qsd")
    sub.add_parser("down", help="release every volume, stop the cluster, check that nothing is left")
    sub.add_parser("status", help="whether the cluster is up, and how to use it")
    example = sub.add_parser("example", help="print deploy/examples/NAME as this cluster runs it")
    example.add_argument("name")
    keeper = sub.add_parser("keep")  # the keeper itself, started by `up`
    keeper.add_argument("base", type=Path)
    args = parser.parse_args(argv)
    if args.command == "keep":
        return keep(args.base)
    if args.command == "example":
        print(yaml.safe_dump_all(local_example(args.name), sort_keys=False), end="")
        return 0
    return {"up": up, "down": down, "status": status}[args.command](state_dir())


if __name__ == "__main__":
    sys.exit(main())
