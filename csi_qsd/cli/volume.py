"""`csi-qsd volume …`: drive a served csi-qsd over CSI gRPC, as a provisioner and kubelet would, and back it up.

The flags of each action; what each does is in `volume_actions`.
"""

from __future__ import annotations

import argparse
import asyncio

from csi_qsd.cli import arg_types
from csi_qsd.cli.common import Subcommands, option, output_flag
from csi_qsd.cli.for_people import for_a_person
from csi_qsd.cli.volume_actions import run_action
from csi_qsd.config import DEFAULT_STATE_DIR
from csi_qsd.sys.tools import bundled


def add_parser(sub: Subcommands) -> None:
    client = sub.add_parser("volume", help="drive a served csi-qsd over CSI gRPC")
    option(client, "--endpoint", f"unix://{DEFAULT_STATE_DIR}/csi.sock", "CSI endpoint to talk to")
    actions = client.add_subparsers(dest="action", required=True)
    _volume_actions(actions)
    _node_actions(actions)
    _lease_actions(actions)
    _backup_actions(actions)


def _volume_actions(actions: Subcommands) -> None:
    """The controller's calls: volumes and snapshots made, listed, grown, deleted."""
    create = actions.add_parser("create", help="CreateVolume")
    create.add_argument("name")
    create.add_argument("--size", default="1Gi", type=arg_types.size, help="bytes, or with suffix Ki/Mi/Gi/Ti")
    create.add_argument("--param", action="append", default=[], type=arg_types.param, metavar="KEY=VALUE",
                        help="StorageClass parameter (repeatable)")
    create.add_argument("--block", action="store_true", help="request the block access type")
    source = create.add_mutually_exclusive_group()
    source.add_argument("--from-snapshot", default="", metavar="SNAPSHOT_ID", help="restore a snapshot")
    source.add_argument("--from-volume", default="", metavar="VOLUME_ID", help="clone a volume")
    output_flag(create)
    output_flag(actions.add_parser("list", help="ListVolumes"))
    snapshot = actions.add_parser("snapshot", help="CreateSnapshot")
    snapshot.add_argument("name")
    snapshot.add_argument("volume_id")
    output_flag(snapshot)
    output_flag(actions.add_parser("snapshots", help="ListSnapshots"))
    delete_snapshot = actions.add_parser("delete-snapshot", help="DeleteSnapshot")
    delete_snapshot.add_argument("snapshot_id")
    expand = actions.add_parser("expand", help="NodeExpandVolume")
    expand.add_argument("volume_id")
    expand.add_argument("path", help="the volume's staging or target path")
    expand.add_argument("--size", required=True, type=arg_types.size, help="bytes, or with suffix Ki/Mi/Gi/Ti")
    output_flag(expand)
    delete = actions.add_parser("delete", help="DeleteVolume")
    delete.add_argument("volume_id")


def _node_actions(actions: Subcommands) -> None:
    """The node's calls, as kubelet makes them, and what the plugin says of itself."""
    stage = _call(actions, "stage", "NodeStageVolume", "volume_id", "staging_path")
    stage.add_argument("--block", action="store_true")
    stage.add_argument("--fs-type", default="")
    stage.add_argument("--mount-group", default="")
    _call(actions, "unstage", "NodeUnstageVolume", "volume_id", "staging_path")
    publish = _call(actions, "publish", "NodePublishVolume", "volume_id", "staging_path", "target_path")
    publish.add_argument("--block", action="store_true")
    publish.add_argument("--readonly", action="store_true")
    publish.add_argument("--mount-group", default="")
    _call(actions, "unpublish", "NodeUnpublishVolume", "volume_id", "target_path")
    stats = actions.add_parser("stats", help="NodeGetVolumeStats")
    stats.add_argument("volume_id")
    stats.add_argument("path")
    output_flag(stats)
    output_flag(actions.add_parser("info", help="GetPluginInfo, Probe and GetCapacity"))


def _call(actions: Subcommands, name: str, rpc: str, *positionals: str) -> argparse.ArgumentParser:
    """The parser of an action that makes the CSI call `rpc`, with its positional arguments."""
    parser = actions.add_parser(name, help=rpc)
    for positional in positionals:
        parser.add_argument(positional)
    return parser


def _lease_actions(actions: Subcommands) -> None:
    """The leases this node serves to copies on other nodes."""
    output_flag(actions.add_parser("leases", help="the leases this node serves to copies on other nodes (how long since "
                                              "each copy renewed it)"))
    drop_lease = actions.add_parser("drop-lease", help="stop serving a copy on another node (its node gone for "
                                    "good) and free its snapshot; that copy loses what it has not copied")
    drop_lease.add_argument("copy_volume_id", help="the copy's volume ID, as `leases` lists it")
    lift_lease = actions.add_parser("lift-lease", help="lift a drop-lease: the copy's node may lease that copy "
                                    "again (a drop is otherwise kept until the copy's volume is deleted)")
    lift_lease.add_argument("copy_volume_id", help="the copy's volume ID, as `leases` lists it (state revoked)")


def _backup_actions(actions: Subcommands) -> None:
    """Backups of snapshots to qcow2 files, and an NBD view of one; run on the snapshot's node."""
    backup = actions.add_parser("backup", help="qcow2 backup of a snapshot: the ranges GetMetadataAllocated "
                                "(full) or GetMetadataDelta (--since) lists, read from its frozen images on this node")
    backup.add_argument("snapshot_id")
    backup.add_argument("--since", default="", metavar="BASE_SNAPSHOT_ID", help="incremental since this snapshot")
    backup.add_argument("-o", "--output", required=True, help="the qcow2 file to write (and FILE.json beside it)")
    _key_file(backup, "of an encrypted volume's snapshot: the backup is a qcow2 encrypted with it (LUKS)")
    option(backup, "--state-dir", str(DEFAULT_STATE_DIR), "the driver's state dir, whose catalog names the images")
    option(backup, "--qemu-img", bundled("qemu-img"), "qemu-img executable")
    option(backup, "--qemu-nbd", bundled("qemu-nbd"), "qemu-nbd executable")
    export = actions.add_parser("nbd-export", help="serve a snapshot read-only over NBD on a UNIX socket, with its "
                                "changed-block bitmaps, until interrupted (on the snapshot's node)")
    export.add_argument("snapshot_id")
    export.add_argument("--socket", required=True, help="the UNIX socket to serve on")
    option(export, "--state-dir", str(DEFAULT_STATE_DIR), "the driver's state dir, whose catalog names the images")
    option(export, "--qemu-img", bundled("qemu-img"), "qemu-img executable")
    option(export, "--qemu-nbd", bundled("qemu-nbd"), "qemu-nbd executable")
    restore = actions.add_parser("restore", help="one image from a full backup and its incrementals, oldest first")
    restore.add_argument("backups", nargs="+")
    restore.add_argument("-o", "--output", required=True)
    restore.add_argument("--format", default="qcow2", choices=["qcow2", "raw"])
    _key_file(restore, "of encrypted backups: the image written is a qcow2 encrypted with it (LUKS)")
    option(restore, "--qemu-img", bundled("qemu-img"), "qemu-img executable")


def _key_file(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--key-file", default="", metavar="FILE",
                        help=f"a file holding the volume's passphrase (the Secret's entry 'key', its bytes exactly), "
                             f"{what}; never on the command line")


def run(args: argparse.Namespace) -> int:
    return for_a_person(lambda: asyncio.run(run_action(args)), args.endpoint)
