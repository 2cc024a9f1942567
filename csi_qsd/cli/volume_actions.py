"""What each `csi-qsd volume` action does: one CSI call (or a backup step) and its answer shown.

Each action is one small coroutine in `ACTIONS`, keyed by the action's
name; a new action is its parser in `volume` and a line here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import Message

from csi_qsd.cli import present
from csi_qsd.cli.client import CSIClient
from csi_qsd.cli.for_people import show
from csi_qsd.config import Config
from csi_qsd.sys.volume_keys import VolumeKey

Action = Callable[[CSIClient, argparse.Namespace], Awaitable[int]]
Shown = TypeVar("Shown", bound="Message | Mapping[str, object]")


async def run_action(args: argparse.Namespace) -> int:
    """Run the action `args` names against the endpoint it names; its exit status."""
    async with CSIClient(args.endpoint) as client:
        return await ACTIONS[args.action](client, args)


def _listing(fetch: Callable[[CSIClient], Awaitable[Sequence[Shown]]], table: Callable[[Sequence[Shown]], str],
             empty: str) -> Action:
    """An action that lists what `fetch` asks for, as `table` shows it (`empty` when there is nothing)."""
    async def listed(client: CSIClient, args: argparse.Namespace) -> int:
        records = await fetch(client)
        show(args, records, lambda: table(records), empty)
        return 0
    return listed


async def _create(client: CSIClient, args: argparse.Namespace) -> int:
    volume = await client.create_volume(args.name, args.size, dict(args.param), block=args.block,
                                        from_snapshot=args.from_snapshot, from_volume=args.from_volume)
    show(args, [volume], lambda: present.volume_table(volume))
    return 0


async def _list(client: CSIClient, args: argparse.Namespace) -> int:
    entries = await client.list_volume_entries()
    show(args, [entry.volume for entry in entries], lambda: present.volumes_table(entries), "no volumes")
    return 0


async def _snapshot(client: CSIClient, args: argparse.Namespace) -> int:
    snapshot = await client.create_snapshot(args.name, args.volume_id)
    show(args, [snapshot], lambda: present.snapshots_table([snapshot]))
    return 0


async def _delete_snapshot(client: CSIClient, args: argparse.Namespace) -> int:
    await client.delete_snapshot(args.snapshot_id)
    return 0


async def _expand(client: CSIClient, args: argparse.Namespace) -> int:
    capacity = await client.expand(args.volume_id, args.path, args.size)
    show(args, [{"capacity_bytes": capacity}], lambda: present.capacity_table(args.volume_id, capacity))
    return 0


async def _delete(client: CSIClient, args: argparse.Namespace) -> int:
    await client.delete_volume(args.volume_id)
    return 0


async def _stage(client: CSIClient, args: argparse.Namespace) -> int:
    await client.stage(args.volume_id, args.staging_path, block=args.block, fs_type=args.fs_type,
                       mount_group=args.mount_group)
    return 0


async def _unstage(client: CSIClient, args: argparse.Namespace) -> int:
    await client.unstage(args.volume_id, args.staging_path)
    return 0


async def _publish(client: CSIClient, args: argparse.Namespace) -> int:
    await client.publish(args.volume_id, args.staging_path, args.target_path, block=args.block,
                         readonly=args.readonly, mount_group=args.mount_group)
    return 0


async def _unpublish(client: CSIClient, args: argparse.Namespace) -> int:
    await client.unpublish(args.volume_id, args.target_path)
    return 0


async def _stats(client: CSIClient, args: argparse.Namespace) -> int:
    stats = await client.stats(args.volume_id, args.path)
    show(args, [stats], lambda: present.stats_table(stats))
    return 0


async def _info(client: CSIClient, args: argparse.Namespace) -> int:
    plugin = await client.plugin_info()
    info = present.PluginInfo(name=plugin.name, version=plugin.vendor_version, ready=await client.probe(),
                              available_bytes=await client.capacity())
    show(args, [info], lambda: present.info_table(info))
    return 0


async def _drop_lease(client: CSIClient, args: argparse.Namespace) -> int:
    dropped = await client.drop_copy_lease(args.copy_volume_id)
    print(f"dropped the lease of copy {dropped['copy_volume_id']} (node {dropped['node']}, snapshot "
          f"{dropped['snapshot_id']})", file=sys.stderr)
    return 0


async def _lift_lease(client: CSIClient, args: argparse.Namespace) -> int:
    lifted = await client.lift_copy_lease_drop(args.copy_volume_id)
    print(f"lifted the drop of copy {lifted['copy_volume_id']}: node {lifted['node']} may lease it again",
          file=sys.stderr)
    return 0


async def _nbd_export(client: CSIClient, args: argparse.Namespace) -> int:
    from csi_qsd.backup import snapshot_nbd

    return await snapshot_nbd.serve(Config(state_dir=Path(args.state_dir)).catalog_path, args.snapshot_id,
                                    Path(args.socket), qemu_img=args.qemu_img, qemu_nbd=args.qemu_nbd)


def _key(args: argparse.Namespace) -> VolumeKey | None:
    """The passphrase `--key-file` names, or None without one."""
    from csi_qsd.backup import keys

    return keys.read_key_file(Path(args.key_file)) if args.key_file else None


async def _backup(client: CSIClient, args: argparse.Namespace) -> int:
    from csi_qsd.backup import incremental

    report = await incremental.backup_snapshot(
        client, Config(state_dir=Path(args.state_dir)).catalog_path, args.snapshot_id, Path(args.output),
        since=args.since, qemu_img=args.qemu_img, qemu_nbd=args.qemu_nbd, key=_key(args))
    print(json.dumps(dataclasses.asdict(report)))
    return 0


async def _restore(client: CSIClient, args: argparse.Namespace) -> int:
    from csi_qsd.backup import incremental

    report = await incremental.restore([Path(b) for b in args.backups], Path(args.output),
                                       qemu_img=args.qemu_img, fmt=args.format, key=_key(args))
    print(json.dumps(dataclasses.asdict(report)))
    return 0


ACTIONS: dict[str, Action] = {
    "create": _create,
    "list": _list,
    "snapshot": _snapshot,
    "snapshots": _listing(lambda client: client.list_snapshots(), present.snapshots_table, "no snapshots"),
    "delete-snapshot": _delete_snapshot,
    "expand": _expand,
    "delete": _delete,
    "stage": _stage,
    "unstage": _unstage,
    "publish": _publish,
    "unpublish": _unpublish,
    "stats": _stats,
    "info": _info,
    "leases": _listing(lambda client: client.copy_leases(), present.leases_table, "no leases"),
    "drop-lease": _drop_lease,
    "lift-lease": _lift_lease,
    "nbd-export": _nbd_export,
    "backup": _backup,
    "restore": _restore,
}
