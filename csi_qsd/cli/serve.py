"""`csi-qsd serve`: the CSI driver on a UNIX socket, with its QSD (managed) or beside it (external)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys

from csi_qsd import __version__
from csi_qsd.cli import arg_types
from csi_qsd.cli.common import Subcommands, common_flags, config_from, env_list, env_name, option, setup_logging
from csi_qsd.cli.qsd_stop import qsd_pids
from csi_qsd.config import DEFAULT_COPY_CALLS_PER_NODE, DEFAULT_DRIVER_NAME, DEFAULT_TARGET_ROOT, Config
from csi_qsd.errors import DriverError
from csi_qsd.qsd.features import FUSE_IOTHREADS_MIN_CORES, FuseThreads, LoopIO
from csi_qsd.qsd.file_aio import FileIO
from csi_qsd.qsd.settings import QSDMode
from csi_qsd.sys.runtime import DEFAULT_RUNTIME_DIR
from csi_qsd.sys.signals import stop_event


def add_parser(sub: Subcommands) -> None:
    serve = sub.add_parser("serve", help="serve the CSI driver on a UNIX socket")
    common_flags(serve)
    _node_flags(serve)
    _pool_flags(serve)
    _listener_flags(serve)
    _copy_flags(serve)


def _node_flags(serve: argparse.ArgumentParser) -> None:
    """Where the driver serves, as which node, and how QSD serves its volumes."""
    option(serve, "--endpoint", "", "CSI endpoint, unix:///path (default: unix://<state-dir>/csi.sock)")
    option(serve, "--node-id", "", "this node's ID (default: the host name)")
    option(serve, "--driver-name", DEFAULT_DRIVER_NAME, "CSI driver name")
    option(serve, "--target-root", str(DEFAULT_TARGET_ROOT),
            "staging and target paths must lie under this directory (kubelet's root)")
    option(serve, "--metrics-address", "", "host:port for Prometheus metrics (empty: off)")
    option(serve, "--qsd-mode", QSDMode.MANAGED.value,
            "managed: start QSD ourselves; external: adopt the one `csi-qsd qsd-run` keeps running",
            choices=[m.value for m in QSDMode])
    option(serve, "--loop-io", LoopIO.AUTO.value,
            "loop devices of container volumes: auto (direct I/O where QSD's FUSE export is known to keep "
            "parallel writes intact, >= 10.0.8), direct or buffered", choices=[m.value for m in LoopIO])
    option(serve, "--file-io", FileIO.AUTO.value,
            "how QSD reads and writes the file pool's images: auto (io_uring where QSD has it, else its thread "
            "pool; the host's page cache), threads, direct (auto's engine with O_DIRECT) or native (Linux AIO, "
            "O_DIRECT)", choices=[m.value for m in FileIO])
    option(serve, "--fuse-threads", FuseThreads.AUTO.value,
            "where QSD >= 11 serves FUSE exports (container volumes): auto (the --iothreads pool, one /dev/fuse "
            f"queue each, on nodes of {FUSE_IOTHREADS_MIN_CORES} or more cores; the main loop on smaller ones), "
            "pool or main", choices=[m.value for m in FuseThreads])
    option(serve, "--managed-pool", "", "KIND:SIZE[,sparse], e.g. xfs:200Gi: the pool directory on an XFS "
            "filesystem the driver makes in one file of the state dir (reserved in full on the host, or taking "
            "host space as the pool fills with ',sparse'), on a direct-I/O loop device, mounted at --pool-dir; reused or attached and mounted "
            "again at every start, grown when SIZE grows, never shrunk (empty: a plain directory)",
            type=arg_types.managed_pool, metavar="KIND:SIZE[,sparse]")
    option(serve, "--max-volumes", "0", "volumes this node may hold, reported to Kubernetes (0: no limit)")


def _pool_flags(serve: argparse.ArgumentParser) -> None:
    """The device and remote pools beside the file pool, and how long QSD may be silent."""
    serve.add_argument("--device-pool", action="append", type=arg_types.device_pool, metavar="NAME=PATH|nvme://PCI[/NS][,force]",
                       default=env_list(serve, "--device-pool", arg_types.device_pool),
                       help="a whole block device carved into volumes, chosen with the StorageClass parameter "
                            "'pool: NAME'; PATH a stable name such as /dev/disk/by-id/…, or nvme://PCI[/NAMESPACE] "
                            "(e.g. nvme://0000:01:00.0/1) for a controller bound to vfio-pci that QSD drives "
                            "itself (VM volumes only); ',force' takes a device "
                            f"holding a partition table or filesystem (repeatable; env {env_name('--device-pool')}, "
                            "space-separated)")
    serve.add_argument("--remote-pool", action="append", type=arg_types.remote_pool,
                       metavar="NAME=URL[,secret=DIR][,tls=DIR|,insecure][,on-error=wait|fail][,force]",
                       default=env_list(serve, "--remote-pool", arg_types.remote_pool),
                       help="a remote target carved into volumes like a device pool, reached by QSD's own "
                            "drivers: iscsi://HOST[:PORT]/IQN/LUN (secret=DIR holds CHAP 'username' and "
                            "'password'), nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH (tls=DIR: "
                            "ca-cert.pem, client-cert.pem, client-key.pem; required over TCP unless 'insecure' "
                            "is given); on-error: I/O waits for a target that "
                            "went away, or fails after a few seconds (repeatable; env "
                            f"{env_name('--remote-pool')}, space-separated)")
    option(serve, "--qmp-timeout", "10", "seconds QSD may take to answer a QMP command; a QSD that stays "
            "silent longer is treated as dead: logged, killed and replaced", type=arg_types.seconds)



def _listener_flags(serve: argparse.ArgumentParser) -> None:
    """The mutual-TLS listener (snapshot metadata, copies), the peers, and what the driver may do in the API."""
    option(serve, "--metadata-address", "", "host:port of the mutual-TLS listener that serves snapshot metadata "
            "to `csi-qsd snapshot-metadata-router` (empty: off; starts once the three files below exist)")
    option(serve, "--metadata-cert", "", "the listener's certificate (PEM)")
    option(serve, "--metadata-key", "", "its private key (PEM)")
    option(serve, "--metadata-client-ca", "", "CA (PEM) that must have signed the router's client certificate")
    serve.add_argument("--peer", action="append", type=arg_types.node_address, metavar="NAME=HOST:PORT",
                       default=env_list(serve, "--peer", arg_types.node_address),
                       help="another node plugin's metadata listener, asked for snapshots and volumes this node "
                            "does not hold when CreateVolume names one (a restore or clone from another node); "
                            "; only the nodes named here may lease this node's snapshots, each for itself, proven by "
                            "a certificate whose common name and a DNS name are its node name; uses the --metadata-* "
                            f"TLS files (repeatable; env {env_name('--peer')}, space-separated)")
    option(serve, "--peers-from-pods", "", "find the other node plugins in the Kubernetes API instead of --peer: "
            "the running pods of this pod's namespace matching this label selector, each at its pod IP and the "
            "--metadata-address port, read again (at most every 5 s) whenever a copy needs them, so a pod made "
            "again is found at its new IP; needs the service account's permission to list pods there")
    serve.add_argument("--claim-snapshot-contents", action="store_true",
                       default=os.environ.get(env_name("--claim-snapshot-contents"), "") in ("1", "true"),
                       help="label each hand-made (pre-provisioned) VolumeSnapshotContent of this driver whose "
                       "snapshot this node holds with snapshot.storage.kubernetes.io/managed-by=<node>, so this "
                       "node's csi-snapshotter (--node-deployment) takes it; checked every 10 s; needs the service "
                       "account's permission to list and patch volumesnapshotcontents "
                       f"(env {env_name('--claim-snapshot-contents')}=true)")
    option(serve, "--delete-pods-on-rebuild", "true", "after qemu-storage-daemon died and the driver rebuilt a "
            "filesystem or block volume, delete the pods on this node that had it and that a ReplicaSet, "
            "StatefulSet, DaemonSet or Job makes again, so they start on the new mount (their containers hold "
            "the dead one); false: only an event on each such pod and the volume's condition say so; pods whose "
            "mounts take mountPropagation HostToContainer are never deleted; in a pod only (needs the service "
            "account's permission to list and delete pods and create events)", choices=["true", "false"])


def _copy_flags(serve: argparse.ArgumentParser) -> None:
    """How this node serves its snapshots to copies on other nodes."""
    option(serve, "--copy-address", "", "address on which this node serves its snapshots to copies on other "
            "nodes (NBD with TLS); default the --metadata-address host; the host other nodes name this node by "
            "in their --peer (a lease served elsewhere is refused), and never loopback while a --peer is on "
            "another host")
    option(serve, "--copy-ports", "10900-10999", "TCP ports for those NBD servers, LOW-HIGH (one per copy)",
            type=arg_types.port_range)
    option(serve, "--copy-rate", "0", "bytes per second a copy from another node may stream (0: no limit)",
            type=arg_types.size)
    option(serve, "--copy-lease-ttl", "86400", "seconds a lease this node serves lasts after its copy last asked "
            "for it (copies renew theirs while they stream); then it is dropped and its snapshot freed (0: never)",
            type=arg_types.seconds_or_never)
    option(serve, "--copy-leases-per-node", "0", "leases one other node may hold on this node at once, so no "
            "node takes every copy port; a lease beyond it is refused (RESOURCE_EXHAUSTED) until one of that "
            "node's copies is done (0: half of --copy-ports)", type=arg_types.count)
    option(serve, "--copy-calls-per-node", str(DEFAULT_COPY_CALLS_PER_NODE), "copy service calls (Lease, "
            "Release) one other node may have in flight on this node at once; more are refused "
            "(RESOURCE_EXHAUSTED) and retried by that node", type=arg_types.count)
    option(serve, "--runtime-dir", str(DEFAULT_RUNTIME_DIR), "private directory on tmpfs where QEMU's copies of "
            "the node's TLS files (its private key) live only while QEMU loads them; in a pod, mounted at the "
            "same path in QSD's container (deploy/node.yaml)")


async def _serve(config: Config) -> None:
    from csi_qsd.csi.errors import RpcObservers
    from csi_qsd.metrics import serving_metrics
    from csi_qsd.server import serving

    stop = stop_event()
    observers = RpcObservers()
    async with serving(config, observers) as driver, serving_metrics(config, driver, observers):
        print(f"csi-qsd {__version__} listening on {config.endpoint} "
              f"(node {config.node_id}, pool {config.pool})", flush=True)
        await stop.wait()
    if config.qsd_mode is QSDMode.MANAGED:
        _say_qsd_keeps_running(config)


def _say_qsd_keeps_running(config: Config) -> None:
    """After SIGINT or SIGTERM stopped a managed driver: its QSD runs on, on purpose; say so, and how to stop it."""
    pids = qsd_pids(config)
    if not pids:
        return
    listed = ", ".join(str(pid) for pid in pids.values())
    print(f"csi-qsd stopped; qemu-storage-daemon (pid {listed}) keeps running by design: it serves the volumes, so "
          "pods and VMs keep their disks across driver restarts, and the next `csi-qsd serve` adopts it.\n"
          f"To stop it: csi-qsd qsd-stop --state-dir {shlex.quote(str(config.state_dir))}",
          file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    setup_logging(config.log_level)
    try:
        asyncio.run(_serve(config))
    except (DriverError, ValueError) as exc:
        logging.getLogger("csi_qsd").error("event=startup_failed error=%r", str(exc))
        print(f"csi-qsd: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
