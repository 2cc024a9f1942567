"""`csi-qsd`: serve the driver, run QSD beside it, or drive a served driver.

The only place that reads flags and `CSI_QSD_*` environment variables; it
builds a `Config` and hands it down.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from csi_qsd import __version__
from csi_qsd.config import (
    DEFAULT_COPY_CALLS_PER_NODE,
    DEFAULT_COPY_LEASE_TTL,
    DEFAULT_DRIVER_NAME,
    DEFAULT_STATE_DIR,
    DEFAULT_TARGET_ROOT,
    POLL_MAX_NS_RANGE,
    Config,
    parse_remote_pool,
)
from csi_qsd.csi import present
from csi_qsd.csi.client import CSIClient
from csi_qsd.errors import DriverError, FailedPrecondition
from csi_qsd.params import parse_size
from csi_qsd.pools.managed_spec import ManagedPoolSpec
from csi_qsd.pools.spec import DevicePoolSpec
from csi_qsd.qsd import iothreads, shards
from csi_qsd.qsd.features import FUSE_IOTHREADS_MIN_CORES, FuseThreads, LoopIO
from csi_qsd.qsd.file_aio import FileIO
from csi_qsd.qsd.remote_spec import RemotePoolSpec
from csi_qsd.qsd.settings import QSDMode
from csi_qsd.router.config import DEFAULT_SERVER_NAME, NodeAddress, RouterConfig
from csi_qsd.sys.endpoint import socket_path
from csi_qsd.sys.pem import PemFiles
from csi_qsd.sys.runtime import DEFAULT_RUNTIME_DIR
from csi_qsd.sys.signals import stop_event
from csi_qsd.sys.tools import bundled

ENV_PREFIX = "CSI_QSD_"
OUTPUTS = ("table", "json")


T = TypeVar("T")


def env_name(flag: str) -> str:
    """The environment variable that stands for a flag: --state-dir → CSI_QSD_STATE_DIR."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _option(parser: argparse.ArgumentParser, flag: str, default: str, help_text: str, **kw: object) -> None:
    env = env_name(flag)
    parser.add_argument(flag, default=os.environ.get(env, default), help=f"{help_text} (env {env})", **kw)  # type: ignore[arg-type]


def _common(parser: argparse.ArgumentParser) -> None:
    _option(parser, "--state-dir", str(DEFAULT_STATE_DIR), "catalog, QSD sockets and exports live here")
    _option(parser, "--pool-dir", "", "directory for volume images (default: <state-dir>/pool)")
    _option(parser, "--log-level", "info", "debug, info, warning or error")
    _option(parser, "--qsd-binary", bundled("qemu-storage-daemon"), "qemu-storage-daemon executable")
    _option(parser, "--qemu-img", bundled("qemu-img"), "qemu-img executable")
    _option(parser, "--iothreads", str(iothreads.node_cores()), "QSD's iothreads that serve exports: each VM disk "
            "runs in the least loaded one, a FUSE export (QEMU >= 11) in all of them (default: one per core, "
            f"at most {iothreads.MAX_PER_CORE} per core)", type=_iothreads)
    _option(parser, "--poll-max-ns", "", "how long those iothreads poll for new requests before sleeping, in ns "
            "(empty: QEMU's default of 32768; 0: never poll)", type=_poll_max_ns)
    _option(parser, "--qsd-shards", "1", "QSD processes serving this node's volumes, each from its own main "
            "loop (VM disks run there on QEMU 10 and 11): a node's VM disks spread over them and a QSD crash "
            f"takes down one shard's volumes (1..{shards.MAX_SHARDS}; in external mode give `qsd-run` the same "
            "number)", type=_qsd_shards)


def _iothreads(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a number of iothreads, got {text!r}")
    try:
        return iothreads.check_size(int(text), iothreads.node_cores())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _qsd_shards(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a number of QSD shards, got {text!r}")
    try:
        shards.check_count(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return int(text)


def _poll_max_ns(text: str) -> int | None:
    if text == "":
        return None
    if not (text.isascii() and text.isdigit() and int(text) in POLL_MAX_NS_RANGE):
        raise argparse.ArgumentTypeError(f"expected nanoseconds 0..{POLL_MAX_NS_RANGE.stop - 1}, got {text!r}")
    return int(text)


def _seconds_or_never(text: str) -> float:
    """Seconds, 0 for never."""
    return 0.0 if text.strip() in ("0", "0.0") else _seconds(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _device_pool(text: str) -> DevicePoolSpec:
    try:
        return DevicePoolSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _managed_pool(text: str) -> ManagedPoolSpec | None:
    if not text:
        return None
    try:
        return ManagedPoolSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _remote_pool(text: str) -> RemotePoolSpec:
    try:
        return parse_remote_pool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _env_list(parser: argparse.ArgumentParser, flag: str, parse: Callable[[str], T]) -> list[T]:
    """A repeatable flag's values from its variable (space-separated); a bad one is a usage error naming it."""
    name = env_name(flag)
    try:
        return [parse(text) for text in os.environ.get(name, "").split()]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"{name}: {exc}")


def _node_address(text: str) -> NodeAddress:
    try:
        return NodeAddress.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port_range(text: str) -> range:
    low, dash, high = text.partition("-")
    try:
        ports = range(int(low), int(high if dash else low) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW-HIGH ports") from None
    if not ports or ports.start < 1 or ports.stop > 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW-HIGH ports within 1-65535")
    return ports


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(text)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes, or a number with Ki, Mi, Gi or Ti, got {text!r}") from None


def _param(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", dest="output_format", choices=OUTPUTS, default="table",
                        help="table for people, sizes in KiB, MiB, GiB... (default); json: one JSON object "
                             "per line, protobuf field names, for scripts")


def _pem_files(cert: str, key: str, ca: str) -> PemFiles | None:
    return PemFiles(Path(cert), Path(key), Path(ca)) if cert and key and ca else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="csi-qsd", description="CSI driver on qemu-storage-daemon")
    parser.add_argument("--version", action="version", version=f"csi-qsd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the CSI driver on a UNIX socket")
    _common(serve)
    _option(serve, "--endpoint", "", "CSI endpoint, unix:///path (default: unix://<state-dir>/csi.sock)")
    _option(serve, "--node-id", "", "this node's ID (default: the host name)")
    _option(serve, "--driver-name", DEFAULT_DRIVER_NAME, "CSI driver name")
    _option(serve, "--target-root", str(DEFAULT_TARGET_ROOT),
            "staging and target paths must lie under this directory (kubelet's root)")
    _option(serve, "--metrics-address", "", "host:port for Prometheus metrics (empty: off)")
    _option(serve, "--qsd-mode", QSDMode.MANAGED.value,
            "managed: start QSD ourselves; external: adopt the one `csi-qsd qsd-run` keeps running",
            choices=[m.value for m in QSDMode])
    _option(serve, "--loop-io", LoopIO.AUTO.value,
            "loop devices of container volumes: auto (direct I/O where QSD's FUSE export is known to keep "
            "parallel writes intact, >= 10.0.8), direct or buffered", choices=[m.value for m in LoopIO])
    _option(serve, "--file-io", FileIO.AUTO.value,
            "how QSD reads and writes the file pool's images: auto (io_uring where QSD has it, else its thread "
            "pool; the host's page cache), threads, direct (auto's engine with O_DIRECT) or native (Linux AIO, "
            "O_DIRECT)", choices=[m.value for m in FileIO])
    _option(serve, "--fuse-threads", FuseThreads.AUTO.value,
            "where QSD >= 11 serves FUSE exports (container volumes): auto (the --iothreads pool, one /dev/fuse "
            f"queue each, on nodes of {FUSE_IOTHREADS_MIN_CORES} or more cores; the main loop on smaller ones), "
            "pool or main", choices=[m.value for m in FuseThreads])
    _option(serve, "--managed-pool", "", "KIND:SIZE[,sparse], e.g. xfs:200Gi: the pool directory on an XFS "
            "filesystem the driver makes in one file of the state dir (reserved in full on the host, or taking "
            "host space as the pool fills with ',sparse'), on a direct-I/O loop device, mounted at --pool-dir; reused or attached and mounted "
            "again at every start, grown when SIZE grows, never shrunk (empty: a plain directory)",
            type=_managed_pool, metavar="KIND:SIZE[,sparse]")
    _option(serve, "--max-volumes", "0", "volumes this node may hold, reported to Kubernetes (0: no limit)")
    serve.add_argument("--device-pool", action="append", type=_device_pool, metavar="NAME=PATH|nvme://PCI[/NS][,force]",
                       default=_env_list(serve, "--device-pool", _device_pool),
                       help="a whole block device carved into volumes, chosen with the StorageClass parameter "
                            "'pool: NAME'; PATH a stable name such as /dev/disk/by-id/…, or nvme://PCI[/NAMESPACE] "
                            "(e.g. nvme://0000:01:00.0/1) for a controller bound to vfio-pci that QSD drives "
                            "itself (VM volumes only); ',force' takes a device "
                            f"holding a partition table or filesystem (repeatable; env {env_name('--device-pool')}, "
                            "space-separated)")
    serve.add_argument("--remote-pool", action="append", type=_remote_pool,
                       metavar="NAME=URL[,secret=DIR][,tls=DIR|,insecure][,on-error=wait|fail][,force]",
                       default=_env_list(serve, "--remote-pool", _remote_pool),
                       help="a remote target carved into volumes like a device pool, reached by QSD's own "
                            "drivers: iscsi://HOST[:PORT]/IQN/LUN (secret=DIR holds CHAP 'username' and "
                            "'password'), nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH (tls=DIR: "
                            "ca-cert.pem, client-cert.pem, client-key.pem; required over TCP unless 'insecure' "
                            "is given); on-error: I/O waits for a target that "
                            "went away, or fails after a few seconds (repeatable; env "
                            f"{env_name('--remote-pool')}, space-separated)")
    _option(serve, "--qmp-timeout", "10", "seconds QSD may take to answer a QMP command; a QSD that stays "
            "silent longer is treated as dead: logged, killed and replaced", type=_seconds)

    _option(serve, "--metadata-address", "", "host:port of the mutual-TLS listener that serves snapshot metadata "
            "to `csi-qsd snapshot-metadata-router` (empty: off; starts once the three files below exist)")
    _option(serve, "--metadata-cert", "", "the listener's certificate (PEM)")
    _option(serve, "--metadata-key", "", "its private key (PEM)")
    _option(serve, "--metadata-client-ca", "", "CA (PEM) that must have signed the router's client certificate")
    serve.add_argument("--peer", action="append", type=_node_address, metavar="NAME=HOST:PORT",
                       default=_env_list(serve, "--peer", _node_address),
                       help="another node plugin's metadata listener, asked for snapshots and volumes this node "
                            "does not hold when CreateVolume names one (a restore or clone from another node); "
                            "; only the nodes named here may lease this node's snapshots, each for itself, proven by "
                            "a certificate whose common name and a DNS name are its node name; uses the --metadata-* "
                            f"TLS files (repeatable; env {env_name('--peer')}, space-separated)")
    _option(serve, "--peers-from-pods", "", "find the other node plugins in the Kubernetes API instead of --peer: "
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
    _option(serve, "--delete-pods-on-rebuild", "true", "after qemu-storage-daemon died and the driver rebuilt a "
            "filesystem or block volume, delete the pods on this node that had it and that a ReplicaSet, "
            "StatefulSet, DaemonSet or Job makes again, so they start on the new mount (their containers hold "
            "the dead one); false: only an event on each such pod and the volume's condition say so; pods whose "
            "mounts take mountPropagation HostToContainer are never deleted; in a pod only (needs the service "
            "account's permission to list and delete pods and create events)", choices=["true", "false"])
    _option(serve, "--copy-address", "", "address on which this node serves its snapshots to copies on other "
            "nodes (NBD with TLS); default the --metadata-address host; the host other nodes name this node by "
            "in their --peer (a lease served elsewhere is refused), and never loopback while a --peer is on "
            "another host")
    _option(serve, "--copy-ports", "10900-10999", "TCP ports for those NBD servers, LOW-HIGH (one per copy)",
            type=_port_range)
    _option(serve, "--copy-rate", "0", "bytes per second a copy from another node may stream (0: no limit)",
            type=_size)
    _option(serve, "--copy-lease-ttl", "86400", "seconds a lease this node serves lasts after its copy last asked "
            "for it (copies renew theirs while they stream); then it is dropped and its snapshot freed (0: never)",
            type=_seconds_or_never)
    _option(serve, "--copy-leases-per-node", "0", "leases one other node may hold on this node at once, so no "
            "node takes every copy port; a lease beyond it is refused (RESOURCE_EXHAUSTED) until one of that "
            "node's copies is done (0: half of --copy-ports)", type=_count)
    _option(serve, "--copy-calls-per-node", str(DEFAULT_COPY_CALLS_PER_NODE), "copy service calls (Lease, "
            "Release) one other node may have in flight on this node at once; more are refused "
            "(RESOURCE_EXHAUSTED) and retried by that node", type=_count)
    _option(serve, "--runtime-dir", str(DEFAULT_RUNTIME_DIR), "private directory on tmpfs where QEMU's copies of "
            "the node's TLS files (its private key) live only while QEMU loads them; in a pod, mounted at the "
            "same path in QSD's container (deploy/node.yaml)")

    router = sub.add_parser("snapshot-metadata-router", help="serve CSI SnapshotMetadata for the cluster on a UNIX "
                            "socket (for the external-snapshot-metadata sidecar), relaying each call to the node "
                            "plugin that holds the snapshot over mutual TLS")
    _option(router, "--endpoint", "unix:///csi/csi.sock", "where the sidecar connects, unix:///path")
    _option(router, "--driver-name", DEFAULT_DRIVER_NAME, "CSI driver name")
    _option(router, "--log-level", "info", "debug, info, warning or error")
    router.add_argument("--node", action="append", type=_node_address, metavar="NAME=HOST:PORT",
                        default=_env_list(router, "--node", _node_address),
                        help="a node plugin's metadata listener (repeatable; env "
                             f"{env_name('--node')}, space-separated); or --nodes-dns")
    _option(router, "--nodes-dns", "", "HOST:PORT where HOST resolves to every node plugin (a headless Service)")
    _option(router, "--tls-cert", "", "the router's client certificate (PEM)")
    _option(router, "--tls-key", "", "its private key (PEM)")
    _option(router, "--tls-ca", "", "CA (PEM) that must have signed the node plugins' certificates")
    _option(router, "--tls-server-name", DEFAULT_SERVER_NAME, "name the node plugins' certificate carries")
    _option(router, "--node-timeout", "5", "seconds a node may take to say whether it holds a snapshot",
            type=_seconds)

    run = sub.add_parser("qsd-run", help="run qemu-storage-daemon in the foreground (its own container)")
    _common(run)

    stop = sub.add_parser("qsd-stop", help="stop the qemu-storage-daemon of a state dir: it outlives `csi-qsd "
                          "serve` by design, so volumes stay served across driver restarts")
    _option(stop, "--state-dir", str(DEFAULT_STATE_DIR), "the driver's state dir (catalog, QSD's pidfile and socket)")
    _option(stop, "--endpoint", "", "the driver's CSI endpoint, which must not be served: a running driver "
            "would start QSD again (default: unix://<state-dir>/csi.sock)")
    stop.add_argument("--force", action="store_true",
                      help="stop it even while the catalog records staged volumes: the pods and VMs using them "
                           "lose their disks (their I/O fails)")

    client = sub.add_parser("volume", help="drive a served csi-qsd over CSI gRPC")
    _option(client, "--endpoint", f"unix://{DEFAULT_STATE_DIR}/csi.sock", "CSI endpoint to talk to")
    actions = client.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="CreateVolume")
    create.add_argument("name")
    create.add_argument("--size", default="1Gi", type=_size, help="bytes, or with suffix Ki/Mi/Gi/Ti")
    create.add_argument("--param", action="append", default=[], type=_param, metavar="KEY=VALUE",
                        help="StorageClass parameter (repeatable)")
    create.add_argument("--block", action="store_true", help="request the block access type")
    source = create.add_mutually_exclusive_group()
    source.add_argument("--from-snapshot", default="", metavar="SNAPSHOT_ID", help="restore a snapshot")
    source.add_argument("--from-volume", default="", metavar="VOLUME_ID", help="clone a volume")
    _output(create)
    _output(actions.add_parser("list", help="ListVolumes"))
    snapshot = actions.add_parser("snapshot", help="CreateSnapshot")
    snapshot.add_argument("name")
    snapshot.add_argument("volume_id")
    _output(snapshot)
    _output(actions.add_parser("snapshots", help="ListSnapshots"))
    delete_snapshot = actions.add_parser("delete-snapshot", help="DeleteSnapshot")
    delete_snapshot.add_argument("snapshot_id")
    expand = actions.add_parser("expand", help="NodeExpandVolume")
    expand.add_argument("volume_id")
    expand.add_argument("path", help="the volume's staging or target path")
    expand.add_argument("--size", required=True, type=_size, help="bytes, or with suffix Ki/Mi/Gi/Ti")
    _output(expand)
    delete = actions.add_parser("delete", help="DeleteVolume")
    delete.add_argument("volume_id")
    for name, text in (("stage", "NodeStageVolume"), ("unstage", "NodeUnstageVolume")):
        p = actions.add_parser(name, help=text)
        p.add_argument("volume_id")
        p.add_argument("staging_path")
        if name == "stage":
            p.add_argument("--block", action="store_true")
            p.add_argument("--fs-type", default="")
            p.add_argument("--mount-group", default="")
    publish = actions.add_parser("publish", help="NodePublishVolume")
    publish.add_argument("volume_id")
    publish.add_argument("staging_path")
    publish.add_argument("target_path")
    publish.add_argument("--block", action="store_true")
    publish.add_argument("--readonly", action="store_true")
    publish.add_argument("--mount-group", default="")
    unpublish = actions.add_parser("unpublish", help="NodeUnpublishVolume")
    unpublish.add_argument("volume_id")
    unpublish.add_argument("target_path")
    stats = actions.add_parser("stats", help="NodeGetVolumeStats")
    stats.add_argument("volume_id")
    stats.add_argument("path")
    _output(stats)
    _output(actions.add_parser("info", help="GetPluginInfo, Probe and GetCapacity"))
    _output(actions.add_parser("leases", help="the leases this node serves to copies on other nodes (how long since "
                                              "each copy renewed it)"))
    drop_lease = actions.add_parser("drop-lease", help="stop serving a copy on another node (its node gone for "
                                    "good) and free its snapshot; that copy loses what it has not copied")
    drop_lease.add_argument("copy_volume_id", help="the copy's volume ID, as `leases` lists it")
    lift_lease = actions.add_parser("lift-lease", help="lift a drop-lease: the copy's node may lease that copy "
                                    "again (a drop is otherwise kept until the copy's volume is deleted)")
    lift_lease.add_argument("copy_volume_id", help="the copy's volume ID, as `leases` lists it (state revoked)")
    backup = actions.add_parser("backup", help="qcow2 backup of a snapshot: the ranges GetMetadataAllocated "
                                "(full) or GetMetadataDelta (--since) lists, read from its frozen images on this node")
    backup.add_argument("snapshot_id")
    backup.add_argument("--since", default="", metavar="BASE_SNAPSHOT_ID", help="incremental since this snapshot")
    backup.add_argument("-o", "--output", required=True, help="the qcow2 file to write (and FILE.json beside it)")
    _option(backup, "--state-dir", str(DEFAULT_STATE_DIR), "the driver's state dir, whose catalog names the images")
    _option(backup, "--qemu-img", bundled("qemu-img"), "qemu-img executable")
    _option(backup, "--qemu-nbd", bundled("qemu-nbd"), "qemu-nbd executable")
    export = actions.add_parser("nbd-export", help="serve a snapshot read-only over NBD on a UNIX socket, with its "
                                "changed-block bitmaps, until interrupted (on the snapshot's node)")
    export.add_argument("snapshot_id")
    export.add_argument("--socket", required=True, help="the UNIX socket to serve on")
    _option(export, "--state-dir", str(DEFAULT_STATE_DIR), "the driver's state dir, whose catalog names the images")
    _option(export, "--qemu-img", bundled("qemu-img"), "qemu-img executable")
    _option(export, "--qemu-nbd", bundled("qemu-nbd"), "qemu-nbd executable")
    restore = actions.add_parser("restore", help="one image from a full backup and its incrementals, oldest first")
    restore.add_argument("backups", nargs="+")
    restore.add_argument("-o", "--output", required=True)
    restore.add_argument("--format", default="qcow2", choices=["qcow2", "raw"])
    _option(restore, "--qemu-img", bundled("qemu-img"), "qemu-img executable")
    return parser


def config_from(args: argparse.Namespace) -> Config:
    return Config(
        state_dir=Path(args.state_dir),
        pool_dir=Path(args.pool_dir) if args.pool_dir else None,
        managed_pool=getattr(args, "managed_pool", None),
        endpoint=getattr(args, "endpoint", ""),
        node_id=getattr(args, "node_id", "") or os.uname().nodename,
        driver_name=getattr(args, "driver_name", DEFAULT_DRIVER_NAME),
        target_root=Path(getattr(args, "target_root", str(DEFAULT_TARGET_ROOT))),
        log_level=args.log_level,
        metrics_address=getattr(args, "metrics_address", ""),
        qsd_mode=QSDMode(getattr(args, "qsd_mode", QSDMode.MANAGED.value)),
        max_volumes=int(getattr(args, "max_volumes", 0)),
        loop_io=LoopIO(getattr(args, "loop_io", LoopIO.AUTO.value)),
        fuse_threads=FuseThreads(getattr(args, "fuse_threads", FuseThreads.AUTO.value)),
        file_io=FileIO(getattr(args, "file_io", FileIO.AUTO.value)),
        qmp_timeout=float(getattr(args, "qmp_timeout", 10.0)),
        qsd_binary=args.qsd_binary,
        qemu_img=args.qemu_img,
        iothreads=args.iothreads,
        poll_max_ns=args.poll_max_ns,
        qsd_shards=getattr(args, "qsd_shards", 1),
        failpoints=os.environ.get(env_name("--failpoints"), ""),
        device_pools=tuple(getattr(args, "device_pool", None) or ()),
        remote_pools=tuple(getattr(args, "remote_pool", None) or ()),
        metadata_address=getattr(args, "metadata_address", ""),
        metadata_tls=_pem_files(getattr(args, "metadata_cert", ""), getattr(args, "metadata_key", ""),
                                getattr(args, "metadata_client_ca", "")),
        peers=tuple((peer.name, peer.address) for peer in getattr(args, "peer", None) or ()),
        peers_from_pods=getattr(args, "peers_from_pods", ""),
        claim_snapshot_contents=bool(getattr(args, "claim_snapshot_contents", False)),
        delete_pods_on_rebuild=getattr(args, "delete_pods_on_rebuild", "true") == "true",
        kubernetes_api=_kubernetes_api(),
        copy_address=getattr(args, "copy_address", ""),
        copy_ports=getattr(args, "copy_ports", range(10900, 11000)),
        copy_rate=int(getattr(args, "copy_rate", 0)),
        copy_lease_ttl=float(getattr(args, "copy_lease_ttl", DEFAULT_COPY_LEASE_TTL)),
        copy_leases_per_node=int(getattr(args, "copy_leases_per_node", 0)),
        copy_calls_per_node=int(getattr(args, "copy_calls_per_node", DEFAULT_COPY_CALLS_PER_NODE)),
        runtime_dir=Path(getattr(args, "runtime_dir", str(DEFAULT_RUNTIME_DIR))),
    )


def _kubernetes_api() -> str:
    """The API server's host:port Kubernetes gives every pod ('' outside a pod)."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
    return f"{host}:{port}" if host and port else ""


def router_config_from(args: argparse.Namespace) -> RouterConfig:
    tls = _pem_files(args.tls_cert, args.tls_key, args.tls_ca)
    if tls is None:
        raise ValueError("the router needs --tls-cert, --tls-key and --tls-ca")
    return RouterConfig(endpoint=args.endpoint, tls=tls, nodes=tuple(args.node or ()), nodes_dns=args.nodes_dns,
                        driver_name=args.driver_name, server_name=args.tls_server_name,
                        node_timeout=float(args.node_timeout), log_level=args.log_level)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )


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
    pids = _qsd_pids(config)
    if not pids:
        return
    listed = ", ".join(str(pid) for pid in pids.values())
    print(f"csi-qsd stopped; qemu-storage-daemon (pid {listed}) keeps running by design: it serves the volumes, so "
          "pods and VMs keep their disks across driver restarts, and the next `csi-qsd serve` adopts it.\n"
          f"To stop it: csi-qsd qsd-stop --state-dir {shlex.quote(str(config.state_dir))}",
          file=sys.stderr, flush=True)


async def _route(config: RouterConfig) -> None:
    from csi_qsd.router.server import serving_router

    stop = stop_event()
    async with serving_router(config):
        print(f"csi-qsd {__version__} snapshot-metadata router listening on {config.endpoint}", flush=True)
        await stop.wait()


def _qsd_run(config: Config) -> int:
    from csi_qsd.qsd import foreground

    return foreground.run([shards.ShardSettings(config, index) for index in range(config.qsd_shards)])


async def _qsd_stop(args: argparse.Namespace) -> int:
    """Stop the QSD of a state dir: QMP `quit`, wait, then SIGKILL (the supervisor's own shutdown).

    Refused (FailedPrecondition) while a driver serves the endpoint, which
    would start QSD again, and while the catalog records staged volumes,
    unless --force. Raises QSDError if QSD survives SIGKILL.
    """
    from csi_qsd.catalog import Catalog
    from csi_qsd.qsd.daemon import QSDDaemon

    config = Config(state_dir=Path(args.state_dir), endpoint=args.endpoint)
    pids = _qsd_pids(config)
    if not pids:
        print(f"no qemu-storage-daemon runs for {config.state_dir}")
        return 0
    if _accepts(config.socket_path):
        raise FailedPrecondition(f"a driver still serves {config.endpoint}: stop `csi-qsd serve` first, "
                                 "or it starts qemu-storage-daemon again")
    staged: list[str] = []
    if config.catalog_path.exists():
        async with Catalog(config.catalog_path) as catalog:
            staged = [record.volume_id for record in await catalog.stages()]
    if staged and not args.force:
        raise FailedPrecondition(
            f"the catalog records {len(staged)} staged volume(s) ({', '.join(staged)}): stopping "
            "qemu-storage-daemon takes their disks from the pods and VMs using them; unstage them first, "
            "or pass --force")
    for shard, pid in pids.items():
        await QSDDaemon(shards.ShardSettings(config, shard)).shutdown()
        print(f"stopped qemu-storage-daemon (pid {pid}) of {config.state_dir}" + (f", shard {shard}" if shard else ""))
    return 0


def _qsd_pids(config: Config) -> dict[int, int]:
    """The live QSD of every shard of a state dir, by shard (whatever --qsd-shards a driver ran with)."""
    from csi_qsd.qsd.daemon import running_pid

    found = {shard: running_pid(shards.ShardSettings(config, shard)) for shard in range(shards.MAX_SHARDS)}
    return {shard: pid for shard, pid in found.items() if pid is not None}


def _accepts(path: Path) -> bool:
    """True while something listens on the UNIX socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


async def _client(args: argparse.Namespace) -> int:
    async with CSIClient(args.endpoint) as client:
        action = args.action
        if action == "create":
            volume = await client.create_volume(args.name, args.size, dict(args.param), block=args.block,
                                                from_snapshot=args.from_snapshot, from_volume=args.from_volume)
            _show(args, [volume], lambda: present.volume_table(volume))
        elif action == "list":
            entries = await client.list_volume_entries()
            _show(args, [entry.volume for entry in entries], lambda: present.volumes_table(entries), "no volumes")
        elif action == "snapshot":
            snapshot = await client.create_snapshot(args.name, args.volume_id)
            _show(args, [snapshot], lambda: present.snapshots_table([snapshot]))
        elif action == "snapshots":
            snapshots = await client.list_snapshots()
            _show(args, snapshots, lambda: present.snapshots_table(snapshots), "no snapshots")
        elif action == "delete-snapshot":
            await client.delete_snapshot(args.snapshot_id)
        elif action == "expand":
            capacity = await client.expand(args.volume_id, args.path, args.size)
            _show(args, [{"capacity_bytes": capacity}], lambda: present.capacity_table(args.volume_id, capacity))
        elif action == "delete":
            await client.delete_volume(args.volume_id)
        elif action == "stage":
            await client.stage(args.volume_id, args.staging_path, block=args.block, fs_type=args.fs_type,
                               mount_group=args.mount_group)
        elif action == "unstage":
            await client.unstage(args.volume_id, args.staging_path)
        elif action == "publish":
            await client.publish(args.volume_id, args.staging_path, args.target_path, block=args.block,
                                 readonly=args.readonly, mount_group=args.mount_group)
        elif action == "unpublish":
            await client.unpublish(args.volume_id, args.target_path)
        elif action == "stats":
            stats = await client.stats(args.volume_id, args.path)
            _show(args, [stats], lambda: present.stats_table(stats))
        elif action == "info":
            plugin = await client.plugin_info()
            info = present.PluginInfo(name=plugin.name, version=plugin.vendor_version, ready=await client.probe(),
                                      available_bytes=await client.capacity())
            _show(args, [info], lambda: present.info_table(info))
        elif action == "leases":
            leases = await client.copy_leases()
            _show(args, leases, lambda: present.leases_table(leases), "no leases")
        elif action == "drop-lease":
            dropped = await client.drop_copy_lease(args.copy_volume_id)
            print(f"dropped the lease of copy {dropped['copy_volume_id']} (node {dropped['node']}, snapshot "
                  f"{dropped['snapshot_id']})", file=sys.stderr)
        elif action == "lift-lease":
            lifted = await client.lift_copy_lease_drop(args.copy_volume_id)
            print(f"lifted the drop of copy {lifted['copy_volume_id']}: node {lifted['node']} may lease it again",
                  file=sys.stderr)
        elif action == "nbd-export":
            from csi_qsd.backup import snapshot_nbd

            return await snapshot_nbd.serve(Config(state_dir=Path(args.state_dir)).catalog_path, args.snapshot_id,
                                            Path(args.socket), qemu_img=args.qemu_img, qemu_nbd=args.qemu_nbd)
        elif action in ("backup", "restore"):
            from csi_qsd.backup import incremental

            if action == "backup":
                report = await incremental.backup_snapshot(
                    client, Config(state_dir=Path(args.state_dir)).catalog_path, args.snapshot_id, Path(args.output),
                    since=args.since, qemu_img=args.qemu_img, qemu_nbd=args.qemu_nbd)
            else:
                report = await incremental.restore([Path(b) for b in args.backups], Path(args.output),
                                              qemu_img=args.qemu_img, fmt=args.format)
            print(json.dumps(dataclasses.asdict(report)))
    return 0


def _show(args: argparse.Namespace, records: Sequence[Message | Mapping[str, object]], table: Callable[[], str],
          empty: str = "") -> None:
    """Records as a table (`empty` said on stderr when there are none), or as JSON lines with `-o json`."""
    if args.output_format == "json":
        for record in records:
            print(present.json_line(record))
    elif records or not empty:
        print(table())
    else:
        print(empty, file=sys.stderr)


def error_line(exc: Exception, endpoint: str = "") -> str:
    """An error for a person, on one line: `CODE: message` with the CSI (gRPC) code of a call or DriverError.

    A local file or value error has no code and keeps its own message.
    """
    if isinstance(exc, grpc.aio.AioRpcError):
        code, message = exc.code().name, exc.details() or ""
        if exc.code() is grpc.StatusCode.UNAVAILABLE and _no_socket(endpoint):
            message = f"nothing serves {endpoint}: no such socket (is `csi-qsd serve` running?)"
    elif isinstance(exc, DriverError):
        code, message = exc.code.value, str(exc)
    else:
        return " ".join(str(exc).split())
    return f"{code}: {' '.join(message.split())}"


def _no_socket(endpoint: str) -> bool:
    try:
        return not socket_path(endpoint).exists()
    except ValueError:
        return False


def _for_a_person(command: Callable[[], int], endpoint: str = "") -> int:
    """Run a command a person typed: an error is one line on stderr (exit status 1), never a traceback."""
    try:
        return command()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (grpc.aio.AioRpcError, DriverError, OSError, ValueError) as exc:
        print(f"error: {error_line(exc, endpoint)}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "volume":
        return _for_a_person(lambda: asyncio.run(_client(args)), args.endpoint)
    if args.command == "qsd-stop":
        setup_logging("warning")
        return _for_a_person(lambda: asyncio.run(_qsd_stop(args)))
    if args.command == "snapshot-metadata-router":
        setup_logging(args.log_level)
        try:
            asyncio.run(_route(router_config_from(args)))
        except (DriverError, ValueError) as exc:
            print(f"csi-qsd snapshot-metadata-router: cannot start: {exc}", file=sys.stderr)
            return 1
        return 0
    config = config_from(args)
    setup_logging(config.log_level)
    if args.command == "qsd-run":
        return _qsd_run(config)
    try:
        asyncio.run(_serve(config))
    except (DriverError, ValueError) as exc:
        logging.getLogger("csi_qsd").error("event=startup_failed error=%r", str(exc))
        print(f"csi-qsd: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
