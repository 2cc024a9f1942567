"""How QSD opens an encrypted volume's images: a `secret` object, and the LUKS key on every layer.

Every image of an encrypted volume (its top, each snapshot below it) is a
qcow2 with its own LUKS header (`encrypt.format=luks`), all opened by the
volume's passphrase. QEMU reads the key only while it opens a layer: it
takes it from a `secret` object named by `encrypt.key-secret`. Measured on
QSD 10.0.13 and 11.1.3: after `object-del` of that secret the open layers
keep reading and writing, and a `blockdev-reopen` (naming the deleted
secret again) and a `block_resize` of the top succeed. So the secret lives
in QSD only while layers are opened (`loaded`), never longer; the key
itself then lives in QEMU's memory as the layers' master keys. A backing
layer QEMU opens from the header alone is refused ("Parameter
'encrypt.key-secret' is required for cipher"): a fresh open names each
layer below the top with its key (`backing_spec`), read from the images'
headers (never through QEMU), down to a copy's link to another node's
encrypted image file (ciphertext over NBD, opened here with the same key)
and the older layers that node serves under it, each a node of its own. The key goes to QSD over QMP only (base64 in
`data`), never in a file or on a command line; nothing here logs it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from csi_qsd.errors import FailedPrecondition, QSDError
from csi_qsd.params import VolumeParameters
from csi_qsd.qcow2 import backing
from csi_qsd.qcow2.keyed import ITER_TIME_MS as ITER_TIME_MS  # re-exported: QSD's keyslots cost the same
from csi_qsd.qcow2.keyed import local_chain
from csi_qsd.qsd import graph
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.graph import QMPArgs
from csi_qsd.sys.volume_keys import VolumeKey

FORMAT = "luks"


def layer_options(secret_id: str) -> QMPArgs:
    """The options that open one encrypted qcow2 layer with the volume's secret."""
    return {"encrypt": {"format": FORMAT, "key-secret": secret_id}}


def secret_object(secret_id: str, key: VolumeKey) -> QMPArgs:
    return {"qom-type": "secret", "id": secret_id, "data": key.base64(), "format": "base64"}


def chain_below(image: Path) -> list[Path | QMPArgs]:
    """The images `image`'s header chain reads through, newest first, as their headers name them.

    A copy from another node ends in a `json:` name: the source's encrypted
    image file over NBD (`csi_qsd.copy_terms.nbd_backing`), given as those
    options (a qcow2 over that link), to be keyed like any other layer.
    Raises FailedPrecondition for a chain that leaves the local filesystem
    otherwise, or loops; OSError if a header cannot be read.
    """
    local, last, link = local_chain(image)
    found: list[Path | QMPArgs] = list(local)
    if link:
        found.append(_linked_layer(last, link))
    return found


def _linked_layer(image: Path, name: str) -> QMPArgs:
    """The options of an encrypted layer another node serves (its image file over NBD), with the older layers it
    serves the same way as its nested `backing`. Raises FailedPrecondition."""
    try:
        spec = json.loads(name[5:])
    except ValueError:
        spec = None
    layer: object = spec
    while _served_layer(layer):
        assert isinstance(layer, dict)
        layer["file"] = {**layer["file"], "read-only": True}
        layer = layer.get("backing")
    if layer is not None or not isinstance(spec, dict):
        raise FailedPrecondition(f"image {image} reads through {name[:40]}…: an encrypted chain leaves this node "
                                 "only for an encrypted image another node serves")
    return spec


def _served_layer(layer: object) -> bool:
    """Whether `layer` is a qcow2 over another node's NBD export."""
    return (isinstance(layer, dict) and layer.get("driver") == "qcow2"
            and bool(backing.nbd_address("json:" + json.dumps({"file": layer.get("file")}))))


def link_layers(chain: list[Path | QMPArgs], secret_id: str, link: str) -> list[QMPArgs]:
    """The blockdev-add arguments of the layers `chain`'s link reads when it stands on older ones (`_linked_layer`;
    none for one image): oldest first, each keyed, named `link` + 1 (the link's own), 2, ..., each over the next.

    Nodes of their own, named: QEMU opens a layer given as options (not a
    node name) through the backing name its header holds, relative, which
    a layer read over NBD has no directory to resolve against ("Cannot
    generate a base directory for NBD nodes"); and it merges the copy
    image's `json:` backing name into its link's options, so the link is
    named by its node name too.
    """
    found: list[QMPArgs] = []
    layer = chain[-1] if chain and isinstance(chain[-1], dict) else None
    while isinstance(layer, dict):
        found.append({k: v for k, v in layer.items() if k != "backing"})
        layer = layer.get("backing")
    if len(found) < 2:
        return []
    return [{**layer, **layer_options(secret_id), "node-name": f"{link}{i}", "read-only": True,
             "backing": f"{link}{i + 1}" if i < len(found) else None}
            for i, layer in reversed(list(enumerate(found, 1)))]


def backing_spec(chain: list[Path | QMPArgs], params: VolumeParameters, secret_id: str, aio: str, *,
                 direct: bool = False, link: str = "") -> QMPArgs | str | None:
    """The `backing` option of a top layer that reads through `chain` (newest first), each layer keyed.

    A copy image (the layer over another node's link) is read-only only as a backing is, not explicitly:
    the fill's block-stream reopens it writable, which an explicit read-only file node would refuse. A link
    over older layers is the node `link` + 1 (`link_layers`), added before.
    """
    spec: QMPArgs | str | None = None
    for image in reversed(chain):
        if isinstance(image, Path):
            over_link = len(chain) > 1 and not isinstance(chain[-1], Path) and image == chain[-2]
            layer: QMPArgs = {"driver": "qcow2", "file": graph.file_blockdev(
                None, image, params, read_only=not over_link, aio=aio, direct=direct)}
        elif isinstance(image.get("backing"), dict):
            spec = f"{link}1"
            continue
        else:
            layer = dict(image)
        layer.update(layer_options(secret_id))
        if spec is not None:
            layer["backing"] = spec
        spec = layer
    return spec


def keyed(spec: QMPArgs, secret_id: str, chain: list[Path | QMPArgs] | None, params: VolumeParameters, aio: str, *,
          direct: bool = False, link: str = "") -> QMPArgs:
    """`spec` (a format node's blockdev-add arguments) made to open an encrypted layer; with `chain`, its backing
    layers named and keyed too (None: the caller attaches the backing, as blockdev-snapshot does)."""
    spec.update(layer_options(secret_id))
    if chain:
        spec["backing"] = backing_spec(chain, params, secret_id, aio, direct=direct, link=link)
    return spec


async def drop_link_layers(client: QSDClient, link: str) -> None:
    """Remove the older layers named `link` + 1, 2, ... (`link_layers`), newest first, once nothing reads them
    (the copy whole, or its volume closed). Raises QSDError."""
    present, i = await client.node_names(), 1
    while f"{link}{i}" in present:
        await client.blockdev_del(f"{link}{i}")
        i += 1


@contextlib.asynccontextmanager
async def loaded(client: QSDClient, secret_id: str, key: VolumeKey) -> AsyncIterator[None]:
    """The volume's secret in QSD while the body opens layers; removed after, whatever happened.

    A secret a crashed earlier call left under the ID is replaced: it may
    hold another key.
    """
    objects = {str(item["name"]) for item in await client.execute("qom-list", {"path": "/objects"})}
    if secret_id in objects:
        await client.execute("object-del", {"id": secret_id})
    await client.execute("object-add", secret_object(secret_id, key))
    try:
        yield
    finally:
        with contextlib.suppress(QSDError):
            await client.execute("object-del", {"id": secret_id})


async def amend_live(client: QSDClient, node: str, secret_id: str, opened_by: VolumeKey, key: VolumeKey, *,
                     add: bool) -> None:
    """Add a keyslot for `key` to the open, writable layer `node` (`add`), or erase every keyslot `key` opens.

    QMP `x-blockdev-amend` with the qcow2 driver's `encrypt` options (QSD
    10.0 and 11.1 alike), while the exports on the layer keep serving: it
    runs as a job in QSD's main loop. Measured with a writer on the layer:
    no I/O error; an add (QEMU benchmarks PBKDF2, then derives the slot)
    holds that loop, so every export of that QSD, for about 1.1 s, an erase
    for about 0.3 s. The master key stays, so the data is not rewritten.
    `opened_by` (a key the layer opens with: QSD no longer holds the one it
    was opened with, see `loaded`) and `key` are in QSD only for the job.
    QEMU refuses to erase the last keyslot. Raises QSDError.
    """
    job_id = "rekey-" + node
    await client.finish_plain_job(job_id)  # one a crash left behind
    opener, other = secret_id + "-o", secret_id + "-n"
    if add:
        encrypt: QMPArgs = {"format": FORMAT, "state": "active", "new-secret": other, "secret": opener,
                            "iter-time": ITER_TIME_MS}
    else:  # QEMU takes no opening key for an erase
        encrypt = {"format": FORMAT, "state": "inactive", "old-secret": other}
    async with loaded(client, opener, opened_by), loaded(client, other, key):
        await client.execute("x-blockdev-amend", {"job-id": job_id, "node-name": node,
                                                  "options": {"driver": "qcow2", "encrypt": encrypt}})
        await client.finish_plain_job(job_id)
