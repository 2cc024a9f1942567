"""Bring a volume's nodes and exports into QSD, or take them out, idempotently.

Each function first looks at the live graph, so it is safe to call again after
a crash at any point: it finishes what is missing and leaves what is there.
A volume's top image has a generation; its older images are opened by QEMU
itself from the backing-file chain, or stay as our named nodes under the top
after a live snapshot. Over the top sits the volume's throttle filter, bound
to its own throttle group: every export stands on the filter, so the limits
hold for every consumer and change live, and a snapshot's switch of the top
below it leaves filter and exports in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from csi_qsd.errors import FailedPrecondition, OutOfRange, PermissionDenied, QSDError
from csi_qsd.params import NODE_STAGE_SECRET, SECRET_KEY, QoS, VolumeParameters
from csi_qsd.qcow2 import header
from csi_qsd.qsd import encryption, graph
from csi_qsd.qsd.block_jobs import format_node_of, nodes_and_bitmaps
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.storage import ImageFile, Storage
from csi_qsd.sys.volume_keys import VolumeKey

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class TopImage:
    """What QSD must have open as a volume's top: the image of `generation`."""

    volume_id: str
    generation: int
    storage: Storage
    params: VolumeParameters
    qos: QoS = QoS()
    # Awaited before QSD opens the image with its backing chain from disk; raises if that open could hold
    # QSD's monitor (a chain that reads through another node that does not answer: `csi_qsd.controller.copy_targets`).
    before_open: Callable[[], Awaitable[None]] | None = dataclasses.field(default=None, compare=False)
    # An encrypted volume's passphrase, if this node holds it: QSD gets it only while it opens layers.
    key: VolumeKey | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def nodes(self) -> graph.VolumeNodes:
        return graph.nodes_for(self.volume_id, self.generation)

    def format_blockdev(self, *, read_only: bool, chain: bool = True) -> graph.QMPArgs:
        """The top's format node; an encrypted one keyed, with every layer below it keyed too (`chain`)."""
        spec = graph.format_blockdev(self.nodes, self.params, read_only=read_only)
        return self._keyed(spec, chain=chain)

    def overlay_blockdev(self) -> graph.QMPArgs:
        """A new top's format node opened without its backing (blockdev-snapshot attaches it); keyed if encrypted."""
        return self._keyed(graph.overlay_blockdev(self.nodes, self.params), chain=False)

    def _keyed(self, spec: graph.QMPArgs, *, chain: bool) -> graph.QMPArgs:
        if not self.params.encrypted:
            return spec
        image = self.image_file()
        below = encryption.chain_below(image.path) if chain else None
        return encryption.keyed(spec, self.nodes.secret, below, self.params, image.aio, direct=image.direct,
                                link=self.nodes.link)

    def image_file(self) -> ImageFile:
        if not isinstance(self.storage, ImageFile):
            raise FailedPrecondition(f"volume {self.volume_id} is encrypted: only image files are")
        return self.storage

    @contextlib.asynccontextmanager
    async def key_loaded(self, client: QSDClient, *, links: bool = True) -> AsyncIterator[None]:
        """The volume's secret in QSD while the body opens its layers (nothing for a plain volume), and with
        `links` the older layers under a copy's link, as nodes of their own (`encryption.link_layers`), which
        go again if the body fails.

        Raises FailedPrecondition for an encrypted volume whose key this node does not hold.
        """
        if not self.params.encrypted:
            yield
            return
        if self.key is None:
            raise FailedPrecondition(
                f"volume {self.volume_id} is encrypted and this node holds no key for it: stage it again with "
                f"the Secret named by {NODE_STAGE_SECRET!r}")
        async with encryption.loaded(client, self.nodes.secret, self.key):
            added: list[str] = []
            try:
                if links:
                    await self._add_link_layers(client, added)
                yield
            except BaseException:
                for name in reversed(added):  # newest first: each frees the next
                    with contextlib.suppress(QSDError):
                        await client.blockdev_del(name)
                raise

    async def _add_link_layers(self, client: QSDClient, added: list[str]) -> None:
        """Add the older layers under a copy's link (`encryption.link_layers`) QSD does not have yet, oldest first;
        each name to `added` as it comes."""
        present = await client.node_names()
        chain = encryption.chain_below(self.image_file().path)
        for spec in encryption.link_layers(chain, self.nodes.secret, self.nodes.link):
            if spec["node-name"] not in present:
                await client.blockdev_add(spec)
                added.append(str(spec["node-name"]))


async def ensure_top(
    client: QSDClient, top: TopImage, *, read_only: bool = False, export: graph.QMPArgs | None = None,
) -> bool:
    """Make `top` the volume's top node (open it fresh, or switch to it live from an older top) under its throttle.

    `export`, the arguments of a block-export-add standing on the throttle
    filter, goes in the same batch when the volume is opened fresh: True
    when it was added so, False when the caller must add it.
    """
    present = await client.node_names()
    if top.before_open is not None and not graph.format_generations(present, top.volume_id):
        await top.before_open()
    if not graph.volume_node_names(present, top.volume_id) and top.nodes.throttle_group not in (
            await client.throttle_groups()):
        await _open_fresh(client, top, read_only, export)
        return export is not None
    await _ensure_format(client, top, present, read_only)
    await _ensure_throttle(client, top, present)
    return False


async def _open_fresh(client: QSDClient, top: TopImage, read_only: bool, export: graph.QMPArgs | None) -> None:
    """A volume QSD holds nothing of: its group and nodes in one go, or none of them, then `export`.

    Sent together (each names only what an earlier one made), so the stage
    pays one QMP round trip for them instead of four or five. An image
    file's protocol node is defined inside its format node, unnamed (it
    closes with it); a device window stays a node of its own. An export
    refused alone leaves the nodes, as a separate export-add would.
    """
    nodes = top.nodes
    image_format = top.format_blockdev(read_only=read_only)
    inline = top.storage.inline_child(top.params, read_only=read_only)
    steps: list[tuple[str, graph.QMPArgs, tuple[str, graph.QMPArgs]]] = [
        ("object-add", graph.throttle_group_object(nodes, top.qos), ("object-del", {"id": nodes.throttle_group})),
    ]
    if inline is not None:
        # One command fewer, and ~110 bytes: QSD reads its monitor a byte per system call (3 us a byte).
        image_format["file"] = inline
    else:
        steps.append(("blockdev-add", top.storage.protocol_blockdev(nodes, top.params, read_only=read_only),
                      ("blockdev-del", {"node-name": nodes.file})))
    steps += [
        ("blockdev-add", image_format, ("blockdev-del", {"node-name": nodes.format})),
        ("blockdev-add", graph.throttle_blockdev(nodes), ("blockdev-del", {"node-name": nodes.throttle})),
    ]
    commands = [(command, args) for command, args, _ in steps]
    async with top.key_loaded(client):
        answers = await client.execute_in_turn(commands + ([("block-export-add", export)] if export else []))
    refused = [answer for answer in answers[:len(steps)] if isinstance(answer, QSDError)]
    if refused:
        for (_command, _args, undo), answer in reversed(list(zip(steps, answers))):
            if not isinstance(answer, QSDError):
                await client.execute(*undo)
        raise refused[0]
    if export and isinstance(answers[-1], QSDError):
        raise answers[-1]


async def _ensure_format(client: QSDClient, top: TopImage, present: set[str], read_only: bool) -> None:
    nodes = top.nodes
    if nodes.format in present:
        return
    older = [g for g in graph.format_generations(present, top.volume_id) if g < top.generation]
    if older:
        await switch_tops(client, [(older[0], top)])
        return
    if nodes.file not in present:
        await client.blockdev_add(top.storage.protocol_blockdev(nodes, top.params, read_only=read_only))
    try:
        async with top.key_loaded(client):
            await client.blockdev_add(top.format_blockdev(read_only=read_only))
    except Exception:
        if nodes.file not in present:
            await client.blockdev_del(nodes.file)
        raise


async def _ensure_throttle(client: QSDClient, top: TopImage, present: set[str]) -> None:
    """The throttle group with the catalog's limits, and the filter over the top format node.

    A group QSD already has gets the catalog's limits again if they differ
    (a ControllerModifyVolume whose live change a crash cut off).
    """
    nodes = top.nodes
    limits = graph.throttle_limits(top.qos)
    if nodes.throttle_group not in await client.throttle_groups():
        await client.execute("object-add", graph.throttle_group_object(nodes, top.qos))
    elif not _same_limits(await client.throttle_limits(nodes.throttle_group), limits):
        await client.set_throttle_limits(nodes.throttle_group, limits)
    if nodes.throttle not in present:
        await client.blockdev_add(graph.throttle_blockdev(nodes))


def _same_limits(live: graph.QMPArgs, wanted: graph.QMPArgs) -> bool:
    return all(live.get(key) == value for key, value in wanted.items())


async def set_limits(client: QSDClient, volume_id: str, qos: QoS) -> bool:
    """Change a volume's I/O limits live; False if QSD has no throttle group for it (not staged here).

    The export and its consumers stay connected: only the group's buckets change.
    """
    group = graph.nodes_for(volume_id).throttle_group
    if group not in await client.throttle_groups():
        return False
    await client.set_throttle_limits(group, graph.throttle_limits(qos))
    return True


async def switch_tops(client: QSDClient, switches: list[tuple[int, TopImage]]) -> None:
    """Move each volume from its top of generation `old` onto the new overlay, all in one transaction.

    The new overlay images must already exist with the old top's image as
    backing file. Exports follow the switch; guests and mounts see no gap.
    """
    added: list[str] = []
    try:
        for _old, top in switches:
            nodes = top.nodes
            await client.blockdev_add(top.storage.protocol_blockdev(nodes, top.params, read_only=False))
            added.append(nodes.file)
            async with top.key_loaded(client):
                await client.blockdev_add(top.overlay_blockdev())
            added.append(nodes.format)
        actions = [
            {"type": "blockdev-snapshot",
             "data": {"node": graph.nodes_for(top.volume_id, old).format, "overlay": top.nodes.format}}
            for old, top in switches
        ]
        await client.execute("transaction", {"actions": actions})
    except QSDError:
        for node in reversed(added):
            try:
                await client.blockdev_del(node)
            except QSDError:
                pass
        raise


async def resize(client: QSDClient, top: TopImage, size: int) -> None:
    """Grow the volume's top image to `size` bytes, live; exports on it see the new size.

    Resized through the throttle filter, which passes it down and tells its
    own parents (the exports) that the size changed. A fixed window (a
    device pool's extent, which its pool has already extended) cannot be
    resized: see `reopen_window`.
    """
    limit = top.storage.max_size()
    if limit is not None and size > limit:
        raise OutOfRange(f"volume {top.volume_id} holds a fixed extent of {limit} bytes and cannot grow to {size}")
    await ensure_top(client, top)
    if limit is None:
        await _drop_inconsistent_bitmaps(client, top.nodes.format)
        guarded = top.nodes.size_guard in await client.node_names()
        if guarded:
            await client.execute("blockdev-reopen", {"options": [graph.size_guard_blockdev(top.nodes, None)]})
        try:  # through the guard when there is one: QEMU lets no resize in below a raw node's parents
            await client.block_resize(top.nodes.size_guard if guarded else top.nodes.throttle, size)
        finally:
            if guarded:
                await _fit_size_guard(client, top)
        return
    await reopen_window(client, top)


async def _drop_inconsistent_bitmaps(client: QSDClient, node: str) -> None:
    """Remove the bitmaps of `node` that a QSD crash left inconsistent: QEMU refuses to resize beside them.

    Such a record is lost already (QEMU never reads it again), and a layer
    whose record is missing counts as lost exactly like one whose record is
    inconsistent (`layer_bitmaps`): a delta that needs it answers with a
    superset. So nothing changed-block tracking knows goes with it.
    """
    _, bitmaps = await nodes_and_bitmaps(client)
    for bitmap in bitmaps.get(node, {}).values():
        if not bitmap.consistent:
            log.warning("event=drop_inconsistent_bitmap node=%s bitmap=%s reason=resize", node, bitmap.name)
            await client.execute("block-dirty-bitmap-remove", {"node": node, "name": bitmap.name})


async def reopen_window(client: QSDClient, top: TopImage) -> None:
    """Make QSD serve the volume's fixed window at its size in the catalog, live; idempotent.

    QEMU refuses to truncate a `raw` node with `size` ("Cannot resize
    fixed-size raw disks"), but accepts a blockdev-reopen with another size
    (measured on QSD 10.0.13); each node re-reads its length only when it is
    reopened itself, so the window, its format node and the throttle filter
    are reopened in turn, bottom up, each draining its requests for a moment
    (measured on 10.0.13, a loop device standing in for the NVMe: the three
    reopens took 20-31 ms, and 4 KiB O_DIRECT writes running through them
    stalled at most 10-17 ms, against a 0.05 ms median). Exports stay up.
    QEMU tells an export's consumers of a new size only after a truncate, so
    none is told: a FUSE export reads the length at every getattr (the loop
    device and filesystem follow), a vhost-user-blk export keeps the size it
    had when it was added.
    """
    nodes = top.nodes
    for options in (top.storage.protocol_blockdev(nodes, top.params, read_only=False),
                    graph.format_blockdev(nodes, top.params, read_only=False),
                    graph.throttle_blockdev(nodes)):
        await client.execute("blockdev-reopen", {"options": [options]})
    if nodes.size_guard in await client.node_names():
        await _fit_size_guard(client, top)


async def _fit_size_guard(client: QSDClient, top: TopImage) -> None:
    """Set the size guard to the throttle filter's length: the volume's size, fixed again."""
    size = (await client.named_nodes())[top.nodes.throttle]["virtual_size"]
    await client.execute("blockdev-reopen", {"options": [graph.size_guard_blockdev(top.nodes, size)]})


async def check_key(client: QSDClient, top: TopImage) -> None:
    """Refuse a key that does not open an encrypted volume's top image, before anything of the volume opens.

    The top layer alone is opened read-only, unlocked (QSD may hold it
    already) and closed again: a refusal of an image whose header says
    LUKS is the key's (PermissionDenied, QEMU's reason with it). A plain
    volume passes. Raises FailedPrecondition for an image not encrypted.
    """
    if not top.params.encrypted:
        return
    image = top.image_file()
    head = header.read_file(image.path)
    if head is None or head.crypt_method != header.CRYPT_LUKS:
        raise FailedPrecondition(f"volume {top.volume_id} is encrypted, but its image {image.path} has no LUKS header")
    probe = top.nodes.secret + "p"
    spec: graph.QMPArgs = {
        "driver": "qcow2", "node-name": probe, "read-only": True, "backing": None,
        "file": {"driver": "file", "filename": str(image.path), "read-only": True, "locking": "off"},
        **encryption.layer_options(top.nodes.secret),
    }
    async with top.key_loaded(client, links=False):
        try:
            await client.blockdev_add(spec)
        except QSDError as exc:
            if exc.error_class != "GenericError":
                raise
            raise PermissionDenied(
                f"the passphrase in entry {SECRET_KEY!r} of the Secret named by {NODE_STAGE_SECRET!r} does not open "
                f"encrypted volume {top.volume_id} ({exc})") from exc
        await client.blockdev_del(probe)


async def remove_volume(client: QSDClient, volume_id: str) -> None:
    """Remove every export and named node of `volume_id` that QSD still has, top first."""
    nodes = graph.nodes_for(volume_id)
    for export_id in (nodes.fuse_export, nodes.vhost_export):
        await client.export_del(export_id)
    own_iothread = graph.own_iothread_id(nodes)
    if own_iothread in await client.iothreads():
        await client.execute("object-del", {"id": own_iothread})
    present = await client.node_names()
    # Sent together, top first (each frees what the next one deletes): one round trip instead of four.
    steps: list[tuple[str, graph.QMPArgs]] = []
    if nodes.size_guard in present:
        steps.append(("blockdev-del", {"node-name": nodes.size_guard}))
    if nodes.throttle in present:
        steps.append(("blockdev-del", {"node-name": nodes.throttle}))
    if nodes.throttle_group in await client.throttle_groups():
        steps.append(("object-del", {"id": nodes.throttle_group}))
    for generation in graph.format_generations(present, volume_id):
        layer = graph.nodes_for(volume_id, generation)
        steps += [("blockdev-del", {"node-name": node}) for node in (layer.format, layer.file) if node in present]
    refused = [answer for answer in await client.execute_in_turn(steps) if isinstance(answer, QSDError)]
    if refused:
        raise refused[0]
    await encryption.drop_link_layers(client, nodes.link)
    for name in await client.node_names():  # a file node whose format node never came up
        if graph.volume_of(name) == volume_id:
            await client.blockdev_del(name)


async def any_open(client: QSDClient, tops: list[TopImage]) -> bool:
    """True if QSD has any of `tops` open as a node."""
    present = await client.node_names()
    return any(top.nodes.format in present for top in tops)


async def exported_volumes(client: QSDClient) -> set[str]:
    """IDs of the volumes QSD has an export of ours for."""
    return {vid for vid in map(graph.volume_of, await client.exports()) if vid is not None}


async def volumes_in_graph(client: QSDClient) -> set[str]:
    """IDs of every volume that has a node, export or throttle group of ours in QSD."""
    names = await client.node_names() | set(await client.exports()) | await client.throttle_groups()
    return {vid for vid in map(graph.volume_of, names) if vid is not None}


async def node_reading(client: QSDClient, image: Path) -> str:
    """The qcow2 node through which QSD reads `image` (opened by name or from a backing chain), or ''."""
    nodes, _ = await nodes_and_bitmaps(client)
    return format_node_of(nodes, str(image))


async def has_object(client: QSDClient, object_id: str) -> bool:
    """True if QSD has the user-created object `object_id`."""
    return object_id in {str(item["name"]) for item in await client.execute("qom-list", {"path": "/objects"})}


async def ensure_tls_client(client: QSDClient, object_id: str, directory: Path, *, reload: bool = False) -> bool:
    """Give QSD the x509 client credentials `object_id` from `directory` (QEMU's file names), unless it has them;
    with `reload`, replace the ones it has by what the files hold now. True if QSD read the files.

    Nodes whose backing files reach another node over NBD name this object (`tls-creds`), so it must exist
    before any of them is opened. QEMU reads the files once, at object-add, and has no reload for it; but
    measured on QSD 10.0.13, `object-del` of the object while NBD nodes use it answers `{}` (each node holds
    the credentials it opened with, and keeps working on them), and an `object-add` under the same ID is
    what the next NBD node opened presents. The renewed files are tried first under a scratch ID, so files
    QEMU refuses (a key that is not the certificate's, a certificate the CA did not sign, or expired) raise
    QSDError and leave the loaded object as it was. Between the delete and the add (two QMP commands) an
    NBD node opened by another call would find no object and fail; a retry succeeds.
    """
    objects = {str(item["name"]) for item in await client.execute("qom-list", {"path": "/objects"})}
    if object_id in objects and not reload:
        return False

    def spec(ident: str) -> dict[str, object]:
        return {"qom-type": "tls-creds-x509", "id": ident, "dir": str(directory), "endpoint": "client",
                "verify-peer": True}

    if object_id in objects:
        scratch = object_id + "-new"
        if scratch in objects:
            await client.execute("object-del", {"id": scratch})
        await client.execute("object-add", spec(scratch))
        await client.execute("object-del", {"id": scratch})
        await client.execute("object-del", {"id": object_id})
    await client.execute("object-add", spec(object_id))
    return True
