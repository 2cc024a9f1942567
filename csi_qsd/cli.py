"""`csi-qsd`: serve the driver, run QSD for a sibling container, or drive a served driver.

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
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf import json_format

from csi_qsd import __version__
from csi_qsd.config import (
    DEFAULT_DRIVER_NAME, DEFAULT_STATE_DIR, DEFAULT_TARGET_ROOT, POLL_MAX_NS_RANGE, Config, parse_remote_pool,
)
from csi_qsd.pools.spec import DevicePoolSpec
from csi_qsd.qsd.settings import QSDMode
from csi_qsd.csi.client import CSIClient
from csi_qsd.qsd.features import FUSE_IOTHREADS_MIN_CORES, FuseThreads, LoopIO
from csi_qsd.errors import DriverError
from csi_qsd.qsd.remote_spec import RemotePoolSpec
from csi_qsd.qsd import iothreads
from csi_qsd.router.config import DEFAULT_SERVER_NAME, NodeAddress, RouterConfig
from csi_qsd.sys.pem import PemFiles
from csi_qsd.sys.signals import stop_event
from csi_qsd.sys.tools import bundled

ENV_PREFIX = "CSI_QSD_"


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


def _iothreads(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a number of iothreads, got {text!r}")
    try:
        return iothreads.check_size(int(text), iothreads.node_cores())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _poll_max_ns(text: str) -> int | None:
    if text == "":
        return None
    if not (text.isascii() and text.isdigit() and int(text) in POLL_MAX_NS_RANGE):
        raise argparse.ArgumentTypeError(f"expected nanoseconds 0..{POLL_MAX_NS_RANGE.stop - 1}, got {text!r}")
    return int(text)


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
    _option(serve, "--fuse-threads", FuseThreads.AUTO.value,
            "where QSD >= 11 serves FUSE exports (container volumes): auto (the --iothreads pool, one /dev/fuse "
            f"queue each, on nodes of {FUSE_IOTHREADS_MIN_CORES} or more cores; the main loop on smaller ones), "
            "pool or main", choices=[m.value for m in FuseThreads])
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
                       metavar="NAME=URL[,secret=DIR][,tls=DIR][,on-error=wait|fail][,force]",
                       default=_env_list(serve, "--remote-pool", _remote_pool),
                       help="a remote target carved into volumes like a device pool, reached by QSD's own "
                            "drivers: iscsi://HOST[:PORT]/IQN/LUN (secret=DIR holds CHAP 'username' and "
                            "'password'), nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH (tls=DIR: "
                            "ca-cert.pem, client-cert.pem, client-key.pem); on-error: I/O waits for a target that "
                            "went away, or fails after a few seconds (repeatable; env "
                            f"{env_name('--remote-pool')}, space-separated)")
    _option(serve, "--qmp-timeout", "10", "seconds QSD may take to answer a QMP command; a QSD that stays "
            "silent longer is treated as dead: logged, killed and replaced", type=_seconds)

    _option(serve, "--metadata-address", "", "host:port of the mutual-TLS listener that serves snapshot metadata "
            "to `csi-qsd snapshot-metadata-router` (empty: off; starts once the three files below exist)")
    _option(serve, "--metadata-cert", "", "the listener's certificate (PEM)")
    _option(serve, "--metadata-key", "", "its private key (PEM)")
    _option(serve, "--metadata-client-ca", "", "CA (PEM) that must have signed the router's client certificate")

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

    client = sub.add_parser("volume", help="drive a served csi-qsd over CSI gRPC")
    _option(client, "--endpoint", f"unix://{DEFAULT_STATE_DIR}/csi.sock", "CSI endpoint to talk to")
    actions = client.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="CreateVolume")
    create.add_argument("name")
    create.add_argument("--size", default="1Gi", help="bytes, or with suffix Ki/Mi/Gi/Ti")
    create.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="StorageClass parameter (repeatable)")
    create.add_argument("--block", action="store_true", help="request the block access type")
    source = create.add_mutually_exclusive_group()
    source.add_argument("--from-snapshot", default="", metavar="SNAPSHOT_ID", help="restore a snapshot")
    source.add_argument("--from-volume", default="", metavar="VOLUME_ID", help="clone a volume")
    actions.add_parser("list", help="ListVolumes")
    snapshot = actions.add_parser("snapshot", help="CreateSnapshot")
    snapshot.add_argument("name")
    snapshot.add_argument("volume_id")
    actions.add_parser("snapshots", help="ListSnapshots")
    delete_snapshot = actions.add_parser("delete-snapshot", help="DeleteSnapshot")
    delete_snapshot.add_argument("snapshot_id")
    expand = actions.add_parser("expand", help="NodeExpandVolume")
    expand.add_argument("volume_id")
    expand.add_argument("path", help="the volume's staging or target path")
    expand.add_argument("--size", required=True, help="bytes, or with suffix Ki/Mi/Gi/Ti")
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
    actions.add_parser("info", help="GetPluginInfo, Probe and GetCapacity")
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


def parse_size(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def config_from(args: argparse.Namespace) -> Config:
    return Config(
        state_dir=Path(args.state_dir),
        pool_dir=Path(args.pool_dir) if args.pool_dir else None,
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
        qmp_timeout=float(getattr(args, "qmp_timeout", 10.0)),
        qsd_binary=args.qsd_binary,
        qemu_img=args.qemu_img,
        iothreads=args.iothreads,
        poll_max_ns=args.poll_max_ns,
        failpoints=os.environ.get(env_name("--failpoints"), ""),
        device_pools=tuple(getattr(args, "device_pool", None) or ()),
        remote_pools=tuple(getattr(args, "remote_pool", None) or ()),
        metadata_address=getattr(args, "metadata_address", ""),
        metadata_tls=_pem_files(getattr(args, "metadata_cert", ""), getattr(args, "metadata_key", ""),
                                getattr(args, "metadata_client_ca", "")),
    )


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


async def _route(config: RouterConfig) -> None:
    from csi_qsd.router.server import serving_router

    stop = stop_event()
    async with serving_router(config):
        print(f"csi-qsd {__version__} snapshot-metadata router listening on {config.endpoint}", flush=True)
        await stop.wait()


def _qsd_run(config: Config) -> None:
    from csi_qsd.qsd.daemon import daemon_argv

    config.qsd_dir.mkdir(parents=True, exist_ok=True)
    argv = daemon_argv(config, daemonize=False)
    os.execvp(argv[0], argv)


async def _client(args: argparse.Namespace) -> int:
    async with CSIClient(args.endpoint) as client:
        action = args.action
        if action == "create":
            params = dict(item.split("=", 1) for item in args.param)
            volume = await client.create_volume(args.name, parse_size(args.size), params, block=args.block,
                                                from_snapshot=args.from_snapshot, from_volume=args.from_volume)
            _print(volume)
        elif action == "list":
            for volume in await client.list_volumes():
                _print(volume)
        elif action == "snapshot":
            _print(await client.create_snapshot(args.name, args.volume_id))
        elif action == "snapshots":
            for snapshot in await client.list_snapshots():
                _print(snapshot)
        elif action == "delete-snapshot":
            await client.delete_snapshot(args.snapshot_id)
        elif action == "expand":
            print(json.dumps({"capacity_bytes": await client.expand(args.volume_id, args.path, parse_size(args.size))}))
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
            _print(await client.stats(args.volume_id, args.path))
        elif action == "info":
            info = await client.plugin_info()
            print(json.dumps({"name": info.name, "version": info.vendor_version,
                              "ready": await client.probe(), "available_bytes": await client.capacity()}))
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


def _print(message: object) -> None:
    print(json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True)))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "volume":
        try:
            return asyncio.run(_client(args))
        except grpc.aio.AioRpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except DriverError as exc:
            print(f"error: {exc.code.value}: {exc}", file=sys.stderr)
            return 1
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
        _qsd_run(config)
        return 0
    try:
        asyncio.run(_serve(config))
    except (DriverError, ValueError) as exc:
        logging.getLogger("csi_qsd").error("event=startup_failed error=%r", str(exc))
        print(f"csi-qsd: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
