"""`csi-qsd snapshot-metadata-router`: one CSI SnapshotMetadata endpoint for the cluster, relaying each call to
the node plugin that holds the snapshot (`csi_qsd.router`)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from csi_qsd import __version__
from csi_qsd.cli import arg_types
from csi_qsd.cli.common import Subcommands, env_list, env_name, option, pem_files, setup_logging
from csi_qsd.config import DEFAULT_DRIVER_NAME
from csi_qsd.errors import DriverError
from csi_qsd.router.config import DEFAULT_SERVER_NAME, RouterConfig
from csi_qsd.sys.signals import stop_event


def add_parser(sub: Subcommands) -> None:
    router = sub.add_parser("snapshot-metadata-router", help="serve CSI SnapshotMetadata for the cluster on a UNIX "
                            "socket (for the external-snapshot-metadata sidecar), relaying each call to the node "
                            "plugin that holds the snapshot over mutual TLS")
    option(router, "--endpoint", "unix:///csi/csi.sock", "where the sidecar connects, unix:///path")
    option(router, "--driver-name", DEFAULT_DRIVER_NAME, "CSI driver name")
    option(router, "--log-level", "info", "debug, info, warning or error")
    router.add_argument("--node", action="append", type=arg_types.node_address, metavar="NAME=HOST:PORT",
                        default=env_list(router, "--node", arg_types.node_address),
                        help="a node plugin's metadata listener (repeatable; env "
                             f"{env_name('--node')}, space-separated); or --nodes-dns")
    option(router, "--nodes-dns", "", "HOST:PORT where HOST resolves to every node plugin (a headless Service)")
    option(router, "--tls-cert", "", "the router's client certificate (PEM)")
    option(router, "--tls-key", "", "its private key (PEM)")
    option(router, "--tls-ca", "", "CA (PEM) that must have signed the node plugins' certificates")
    option(router, "--tls-server-name", DEFAULT_SERVER_NAME, "name the node plugins' certificate carries")
    option(router, "--node-timeout", "5", "seconds a node may take to say whether it holds a snapshot",
            type=arg_types.seconds)



def router_config_from(args: argparse.Namespace) -> RouterConfig:
    tls = pem_files(args.tls_cert, args.tls_key, args.tls_ca)
    if tls is None:
        raise ValueError("the router needs --tls-cert, --tls-key and --tls-ca")
    return RouterConfig(endpoint=args.endpoint, tls=tls, nodes=tuple(args.node or ()), nodes_dns=args.nodes_dns,
                        driver_name=args.driver_name, server_name=args.tls_server_name,
                        node_timeout=float(args.node_timeout), log_level=args.log_level)




async def _route(config: RouterConfig) -> None:
    from csi_qsd.router.server import serving_router

    stop = stop_event()
    async with serving_router(config):
        print(f"csi-qsd {__version__} snapshot-metadata router listening on {config.endpoint}", flush=True)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        asyncio.run(_route(router_config_from(args)))
    except (DriverError, ValueError) as exc:
        print(f"csi-qsd snapshot-metadata-router: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
