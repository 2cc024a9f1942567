"""The L2-table reader against `qemu-img map`: the same ranges for every layout and kind of cluster.

Real images made by qemu-img and written by qemu-io: plain clusters of
several sizes and extended L2 subclusters, with writes that straddle
(sub)cluster boundaries, zero writes, discards, compressed clusters, an end
that is not a whole cluster, metadata preallocation, LUKS encryption (read
without the key, compared with qemu-img's map with it). Images the reader does
not know (version 2, an external data file) answer None, so the caller asks
qemu-img.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from csi_qsd.qcow2 import extents, imagemap, keyed, tables
from csi_qsd.sys.run import run
from csi_qsd.sys.tools import bundled
from csi_qsd.sys.volume_keys import VolumeKey

KIB, MIB = 1 << 10, 1 << 20
SIZE = 64 * MIB + 3 * 512  # not a whole number of clusters
LAYOUTS = [
    "",                                          # the default: 64 KiB clusters
    "cluster_size=131072,extended_l2=on",        # 4 KiB subclusters
    "cluster_size=1048576,extended_l2=on",       # 32 KiB subclusters
    "cluster_size=16384,extended_l2=on",         # 512-byte subclusters
    "cluster_size=2097152",
    "cluster_size=4096",
]
WRITES = [
    "write -P 1 0 4k", "write -P 2 126k 4k", "write -P 3 1m 1536", "write -P 4 3m 200k",
    "write -z 5m 8k", "write -z 6m 1m", "discard 3m 64k", "discard 8m 2m", "write -P 5 40m 12k",
    f"write -P 6 {SIZE - 1024} 1024",
]


def qemu_img(*args: str) -> None:
    subprocess.run([bundled("qemu-img"), *args], check=True, capture_output=True)


def qemu_io(image: Path, *commands: str) -> None:
    argv = [bundled("qemu-io"), "-f", "qcow2"]
    for command in commands:
        argv += ["-c", command]
    subprocess.run([*argv, str(image)], check=True, capture_output=True)


def options(layout: str, *more: str) -> list[str]:
    joined = ",".join(o for o in (layout, *more) if o)
    return ["-o", joined] if joined else []


async def same_as_qemu_img(image: Path) -> list[tuple[int, int]]:
    found = tables.read_layer(image)
    assert found is not None, f"{image} should be readable"
    assert found == await imagemap.mapped_layer(bundled("qemu-img"), image)
    return found


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout or "default")
async def test_layers_read_like_qemu_img_map(tmp_path: Path, layout: str) -> None:
    base, top = tmp_path / "base.qcow2", tmp_path / "top.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", *options(layout), str(base), str(SIZE))
    assert await same_as_qemu_img(base) == []
    qemu_io(base, "write -P 9 0 16m", "write -P 9 40m 2m")
    qemu_img("create", "-q", "-f", "qcow2", *options(layout), "-b", base.name, "-F", "qcow2", str(top), str(SIZE))
    qemu_io(top, *WRITES)
    await same_as_qemu_img(base)
    assert await same_as_qemu_img(top) != []
    # The chain's allocation is the union of its layers'.
    _, out = await run(bundled("qemu-img"), "map", "--output=json", "-U", "-f", "qcow2", str(top))
    assert extents.parse_map(out) == extents.union(await same_as_qemu_img(base), await same_as_qemu_img(top))


@pytest.mark.parametrize("layout", ["", "cluster_size=131072,extended_l2=on"], ids=["default", "4k"])
async def test_compressed_and_preallocated_clusters(tmp_path: Path, layout: str) -> None:
    image = tmp_path / "c.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", *options(layout), str(image), str(SIZE))
    cluster = 131072 if layout else 65536
    qemu_io(image, f"write -c -P 7 {cluster} {cluster}", f"write -c -P 8 {4 * cluster} {2 * cluster}")
    assert await same_as_qemu_img(image) == [(cluster, cluster), (4 * cluster, 2 * cluster)]
    preallocated = tmp_path / "p.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", *options(layout, "preallocation=metadata"), str(preallocated), str(SIZE))
    qemu_io(preallocated, "write -P 1 1m 4k")
    await same_as_qemu_img(preallocated)


async def test_images_it_does_not_know_are_left_to_qemu_img(tmp_path: Path) -> None:
    old = tmp_path / "v2.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-o", "compat=0.10", str(old), str(SIZE))
    external = tmp_path / "ext.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={tmp_path / 'ext.raw'}", str(external), str(SIZE))
    raw = tmp_path / "plain.raw"
    raw.write_bytes(b"\0" * 4096)
    for image in (old, external, raw):
        assert tables.read_layer(image) is None, image
    qemu_io(old, "write -P 1 0 4k")
    assert await imagemap.layer_allocation(bundled("qemu-img"), old) == [(0, 64 * KIB)]


@pytest.mark.parametrize("layout", ["", "cluster_size=131072,extended_l2=on"], ids=["default", "4k"])
async def test_a_luks_layer_reads_like_qemu_img_map_with_its_key(tmp_path: Path, layout: str) -> None:
    """The tables of an encrypted layer are read without the key and say what qemu-img says with it."""
    key = VolumeKey("k-layer").base64().encode()
    image = tmp_path / "luks.qcow2"
    subprocess.run([bundled("qemu-img"), "create", "-q", "-f", "qcow2", "--object", keyed.SECRET,
                    *options(layout, *keyed.CREATE_OPTIONS), str(image), str(SIZE)],
                   input=key, check=True, capture_output=True)
    opened = keyed.json_name(keyed.layer(image, None, read_only=False))
    argv = [bundled("qemu-io"), "--object", keyed.SECRET]
    for command in WRITES:
        argv += ["-c", command]
    subprocess.run([*argv, opened], input=key, check=True, capture_output=True)
    assert keyed.encrypted(image)
    found = tables.read_layer(image)
    _, out = await run(bundled("qemu-img"), "map", "--output=json", "--object", keyed.SECRET, opened, stdin=key)
    assert found == extents.parse_map(out) != []
