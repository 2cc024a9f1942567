"""What the commands share: the rule that names each flag's environment variable, the flags of `serve` and
`qsd-run`, the `Config` they build, and the log format.

The command line is the only place that reads flags and `CSI_QSD_*`
environment variables; it builds a `Config` and hands it down.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias, TypeVar

from csi_qsd.cli import arg_types
from csi_qsd.config import (
    DEFAULT_COPY_CALLS_PER_NODE,
    DEFAULT_COPY_LEASE_TTL,
    DEFAULT_DRIVER_NAME,
    DEFAULT_STATE_DIR,
    DEFAULT_TARGET_ROOT,
    Config,
)
from csi_qsd.qsd import iothreads, shards
from csi_qsd.qsd.features import FuseThreads, LoopIO
from csi_qsd.qsd.file_aio import FileIO
from csi_qsd.qsd.settings import QSDMode
from csi_qsd.sys.pem import PemFiles
from csi_qsd.sys.runtime import DEFAULT_RUNTIME_DIR
from csi_qsd.sys.tools import bundled

ENV_PREFIX = "CSI_QSD_"
OUTPUTS = ("table", "json")
T = TypeVar("T")
# A command's subparsers, as argparse hands them out (a string: not subscriptable at run time on 3.11).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def env_name(flag: str) -> str:
    """The environment variable that stands for a flag: --state-dir → CSI_QSD_STATE_DIR."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def option(parser: argparse.ArgumentParser, flag: str, default: str, help_text: str, **kw: object) -> None:
    env = env_name(flag)
    parser.add_argument(flag, default=os.environ.get(env, default), help=f"{help_text} (env {env})", **kw)  # type: ignore[arg-type]


def common_flags(parser: argparse.ArgumentParser) -> None:
    option(parser, "--state-dir", str(DEFAULT_STATE_DIR), "catalog, QSD sockets and exports live here")
    option(parser, "--pool-dir", "", "directory for volume images (default: <state-dir>/pool)")
    option(parser, "--log-level", "info", "debug, info, warning or error")
    option(parser, "--qsd-binary", bundled("qemu-storage-daemon"), "qemu-storage-daemon executable")
    option(parser, "--qemu-img", bundled("qemu-img"), "qemu-img executable")
    option(parser, "--iothreads", str(iothreads.node_cores()), "QSD's iothreads that serve exports: each VM disk "
            "runs in the least loaded one, a FUSE export (QEMU >= 11) in all of them (default: one per core, "
            f"at most {iothreads.MAX_PER_CORE} per core)", type=arg_types.iothread_count)
    option(parser, "--poll-max-ns", "", "how long those iothreads poll for new requests before sleeping, in ns "
            "(empty: QEMU's default of 32768; 0: never poll)", type=arg_types.poll_max_ns)
    option(parser, "--qsd-shards", "1", "QSD processes serving this node's volumes, each from its own main "
            "loop (VM disks run there on QEMU 10 and 11): a node's VM disks spread over them and a QSD crash "
            f"takes down one shard's volumes (1..{shards.MAX_SHARDS}; in external mode give `qsd-run` the same "
            "number)", type=arg_types.shard_count)




def env_list(parser: argparse.ArgumentParser, flag: str, parse: Callable[[str], T]) -> list[T]:
    """A repeatable flag's values from its variable (space-separated); a bad one is a usage error naming it."""
    name = env_name(flag)
    try:
        return [parse(text) for text in os.environ.get(name, "").split()]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"{name}: {exc}")



def output_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", dest="output_format", choices=OUTPUTS, default="table",
                        help="table for people, sizes in KiB, MiB, GiB... (default); json: one JSON object "
                             "per line, protobuf field names, for scripts")


def pem_files(cert: str, key: str, ca: str) -> PemFiles | None:
    return PemFiles(Path(cert), Path(key), Path(ca)) if cert and key and ca else None




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
        metadata_tls=pem_files(getattr(args, "metadata_cert", ""), getattr(args, "metadata_key", ""),
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




def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
