"""qsd.graph: node names QEMU accepts, names that map back to their volume, and the JSON sent to QSD."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from csi_qsd import validate
from csi_qsd.params import CacheMode, DetectZeroes, Discard, ImageFormat, VolumeParameters
from csi_qsd.qsd import features, graph

# QEMU's block.c keeps node names in char[32] and refuses strlen >= 32; util/id.c's id_wellformed():
# a letter first, then letters, digits, '-', '.' and '_'.
QEMU_NODE_NAME_MAX = 31
QEMU_ID = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*\Z")

VOLUME_IDS = [validate.new_volume_id() for _ in range(20)] + ["vol-" + "0" * 24, "vol-" + "f" * 24]


GENERATIONS = [0, 1, 35, 36, 1295, graph.MAX_GENERATION]


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("volume_id", VOLUME_IDS[:3] + VOLUME_IDS[-2:])
def test_node_names_fit_qemus_limit_and_are_well_formed(volume_id: str, generation: int) -> None:
    nodes = graph.nodes_for(volume_id, generation)
    for name in (nodes.format, nodes.file):
        assert len(name) <= QEMU_NODE_NAME_MAX, name
    for name in (nodes.file, nodes.format, nodes.fuse_export, nodes.vhost_export):
        assert QEMU_ID.match(name), name


def test_longest_node_name_is_exactly_at_the_limit() -> None:
    """The ID length was chosen so the last generation's nodes use all 31 characters: a longer ID would break QSD."""
    nodes = graph.nodes_for(validate.new_volume_id(), graph.MAX_GENERATION)
    assert max(len(n) for n in (nodes.format, nodes.file)) == QEMU_NODE_NAME_MAX
    with pytest.raises(ValueError):
        graph.nodes_for(validate.new_volume_id(), graph.MAX_GENERATION + 1)


def test_names_are_distinct_within_and_across_volumes_and_generations() -> None:
    names = [
        name for vid in VOLUME_IDS for gen in GENERATIONS
        for name in (graph.nodes_for(vid, gen).file, graph.nodes_for(vid, gen).format)
    ]
    assert len(names) == len(set(names)) == 2 * len(VOLUME_IDS) * len(GENERATIONS)
    exports = [e for vid in VOLUME_IDS for e in (graph.nodes_for(vid).fuse_export, graph.nodes_for(vid).vhost_export)]
    assert len(set(exports)) == 2 * len(VOLUME_IDS) and not set(exports) & set(names)


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("volume_id", VOLUME_IDS)
def test_volume_of_round_trip(volume_id: str, generation: int) -> None:
    nodes = graph.nodes_for(volume_id, generation)
    for name in (nodes.file, nodes.format, nodes.fuse_export, nodes.vhost_export):
        assert graph.volume_of(name) == volume_id
    file, fmt, fuse, vhost = (graph.parse_name(n) for n in (nodes.file, nodes.format, nodes.fuse_export,
                                                            nodes.vhost_export))
    assert file is not None and fmt is not None and file.generation == fmt.generation == generation
    assert fuse is not None and vhost is not None and fuse.generation is None and vhost.generation is None


@pytest.mark.parametrize("name", [
    "", "cq", "drive0", "#block123", "iothread0", "cq-file", "cqabc-file", "cq" + "a" * 23 + "-file",
    "cq" + "a" * 25 + "-file", "xq" + "a" * 24 + "-file", "cq" + "a" * 24,
])
def test_volume_of_foreign_names_is_none(name: str) -> None:
    assert graph.volume_of(name) is None


@pytest.mark.parametrize("name", ["cq" + "z" * 24 + "-file", "cq" + "a" * 20 + "-x-y-file"])
def test_volume_of_only_returns_valid_volume_ids(name: str) -> None:
    volume_id = graph.volume_of(name)
    assert volume_id is None or validate.VOLUME_ID_RE.match(volume_id), volume_id


def test_volume_of_never_returns_an_invalid_id_for_hex_names() -> None:
    for volume_id in VOLUME_IDS:
        nodes = graph.nodes_for(volume_id)
        found = graph.volume_of(nodes.file)
        assert found is not None and validate.VOLUME_ID_RE.match(found)


# blockdev and export JSON ------------------------------------------------

NODES = graph.nodes_for("vol-" + "ab" * 12)


def test_file_blockdev() -> None:
    spec = graph.file_blockdev(NODES, Path("/pool/vol-x.qcow2"), VolumeParameters(), read_only=False)
    # QEMU's defaults are left out (aio=threads, cache.direct=off, cache.no-flush=off: flushes reach the disk).
    assert spec == {"driver": "file", "node-name": NODES.file, "filename": "/pool/vol-x.qcow2", "discard": "unmap"}
    ro = graph.file_blockdev(NODES, Path("/p"), VolumeParameters(discard=Discard.IGNORE), read_only=True)
    assert ro["read-only"] is True and ro["discard"] == "ignore"
    json.dumps(spec)


def test_file_blockdev_past_the_page_cache() -> None:
    spec = graph.file_blockdev(NODES, Path("/p"), VolumeParameters(), read_only=False, aio="native", direct=True)
    assert spec["aio"] == "native" and spec["cache"] == {"direct": True}


def test_format_blockdev_qcow2_caps_the_metadata_cache() -> None:
    spec = graph.format_blockdev(NODES, VolumeParameters(detect_zeroes=DetectZeroes.UNMAP), read_only=False)
    assert spec["driver"] == "qcow2" and spec["file"] == NODES.file and spec["node-name"] == NODES.format
    assert spec["l2-cache-size"] == graph.L2_CACHE_BYTES == 1 << 20
    assert spec["detect-zeroes"] == "unmap" and "read-only" not in spec  # QEMU's default: writable
    default = graph.format_blockdev(NODES, VolumeParameters(), read_only=False)
    assert "detect-zeroes" not in default  # off, QEMU's default


def test_format_blockdev_raw_has_no_qcow2_options() -> None:
    spec = graph.format_blockdev(NODES, VolumeParameters(format=ImageFormat.RAW), read_only=True)
    assert spec["driver"] == "raw" and "l2-cache-size" not in spec and spec["read-only"] is True


def test_fuse_export() -> None:
    spec = graph.fuse_export(NODES, Path("/state/exports/v/disk"), writable=True)
    assert spec == {
        "type": "fuse", "id": NODES.fuse_export, "node-name": NODES.throttle, "mountpoint": "/state/exports/v/disk",
        "writable": True, "allow-other": "off",
    }


def test_a_growable_fuse_export_stands_on_the_size_guard() -> None:
    """QEMU 11 offers FUSE_ASYNC_DIO only when growable; a fixed-size raw node keeps the image's size."""
    spec = graph.fuse_export(NODES, Path("/state/exports/v/disk"), writable=True, growable=True)
    assert spec["growable"] is True and spec["node-name"] == NODES.size_guard != NODES.throttle
    assert graph.size_guard_blockdev(NODES, 64 << 20) == {
        "driver": "raw", "node-name": NODES.size_guard, "file": NODES.throttle, "size": 64 << 20}
    assert "size" not in graph.size_guard_blockdev(NODES, None), "lifted for a resize"
    volume_id = "vol-" + NODES.throttle.removeprefix(graph.NODE_PREFIX).removesuffix("-t")
    assert graph.parse_name(NODES.size_guard) == graph.ParsedName(volume_id, graph.NameKind.SIZE_GUARD)
    assert graph.volume_of(NODES.size_guard) == volume_id


def test_vhost_export_is_writethrough_by_default() -> None:
    """DESIGN.md: without writethrough, a QSD crash loses writes the guest saw acknowledged."""
    spec = graph.vhost_user_blk_export(NODES, Path("/s/vhost.sock"), VolumeParameters(), writable=True)
    assert spec["writethrough"] is True
    assert spec["type"] == "vhost-user-blk" and spec["id"] == NODES.vhost_export
    assert spec["node-name"] == NODES.throttle and spec["addr"] == {"type": "unix", "path": "/s/vhost.sock"}
    assert spec["num-queues"] == 64 and spec["logical-block-size"] == 512
    assert spec["iothread"] == graph.IOTHREAD_ID and spec["writable"] is True


def test_vhost_export_in_the_main_loop_names_no_iothread() -> None:
    """Where QSD aborts on clients of an iothread export (10.0), the export runs in the main loop."""
    spec = graph.vhost_user_blk_export(NODES, Path("/s"), VolumeParameters(iothread_poll_max_ns=0), writable=True,
                                       pool_thread=None)
    assert "iothread" not in spec
    assert features.vhost_export_in_iothread((7, 2, 22))
    assert not features.vhost_export_in_iothread((10, 0, 13))
    assert not features.vhost_export_in_iothread((11, 1, 3)), "11.1.3: EBADF under churn with exports in iothreads"
    assert not features.vhost_exports_spread((11, 1, 3))


def test_vhost_export_runs_in_the_pool_thread_given_unless_it_has_its_own() -> None:
    spec = graph.vhost_user_blk_export(NODES, Path("/s"), VolumeParameters(), writable=True, pool_thread="iothread3")
    assert spec["iothread"] == "iothread3"
    own = graph.vhost_user_blk_export(NODES, Path("/s"), VolumeParameters(iothread_poll_max_ns=0), writable=True,
                                      pool_thread="iothread3")
    assert own["iothread"] == graph.own_iothread_id(NODES)


def test_fuse_export_over_a_list_of_iothreads_only_from_qemu_11() -> None:
    pool = ["iothread0", "iothread1"]
    auto, forced, main = features.FuseThreads.AUTO, features.FuseThreads.POOL, features.FuseThreads.MAIN
    assert features.fuse_iothreads((10, 0, 13), pool, 8, auto) is None
    assert features.fuse_iothreads((10, 0, 13), pool, 8, forced) is None  # 10.0 takes no list
    assert features.fuse_iothreads((11, 1, 3), pool, 4, auto) == pool
    assert features.fuse_iothreads((11, 1, 3), pool, 2, auto) is None  # too few cores: the main loop is faster
    assert features.fuse_iothreads((11, 1, 3), pool, 2, forced) == pool
    assert features.fuse_iothreads((11, 1, 3), pool, 8, main) is None
    spec = graph.fuse_export(NODES, Path("/e/disk"), writable=True, iothreads=pool)
    assert spec["iothread"] == pool
    assert "iothread" not in graph.fuse_export(NODES, Path("/e/disk"), writable=True, iothreads=None)


def test_vhost_export_follows_the_parameters() -> None:
    params = VolumeParameters(cache=CacheMode.WRITEBACK, num_queues=8, logical_block_size=4096)
    spec = graph.vhost_user_blk_export(NODES, Path("/s"), params, writable=False)
    assert spec["writethrough"] is False
    assert spec["num-queues"] == 8 and spec["logical-block-size"] == 4096 and spec["writable"] is False


def test_throttle_names_are_ours_and_shared_by_every_generation() -> None:
    volume_id = VOLUME_IDS[0]
    nodes = graph.nodes_for(volume_id, 7)
    assert nodes.throttle == graph.nodes_for(volume_id).throttle
    assert graph.parse_name(nodes.throttle) == graph.ParsedName(volume_id, graph.NameKind.THROTTLE)
    assert graph.parse_name(nodes.throttle_group) == graph.ParsedName(volume_id, graph.NameKind.THROTTLE_GROUP)
    assert len(nodes.throttle) <= QEMU_NODE_NAME_MAX and QEMU_ID.match(nodes.throttle_group)
    assert graph.format_generations([nodes.throttle, nodes.throttle_group, nodes.format], volume_id) == [7]


def test_throttle_filter_sits_on_the_top_format_node() -> None:
    spec = graph.throttle_blockdev(NODES)
    assert spec == {"driver": "throttle", "node-name": NODES.throttle, "throttle-group": NODES.throttle_group,
                    "file": NODES.format}


def test_throttle_limits_name_every_field_so_a_change_lifts_what_it_omits() -> None:
    """qom-set of `limits` changes only the fields given: lifting a limit must send its 0."""
    from csi_qsd.params import QoS
    limits = graph.throttle_limits(QoS(iops_total=200, iops_total_max=400, burst_seconds=5, bps_read=1 << 20))
    assert len(limits) == 18
    assert limits["iops-total"] == 200 and limits["iops-total-max"] == 400 and limits["iops-total-max-length"] == 5
    assert limits["bps-read"] == 1 << 20 and limits["bps-read-max"] == 0 and limits["bps-read-max-length"] == 1
    assert all(v == 0 for k, v in graph.throttle_limits(QoS()).items() if not k.endswith("-length"))
    obj = graph.throttle_group_object(NODES, QoS())
    assert obj["qom-type"] == "throttle-group" and obj["id"] == NODES.throttle_group
    assert "limits" not in obj  # a new group starts at QEMU's defaults: only what differs is sent
    limited = graph.throttle_group_object(NODES, QoS(iops_write=300, bps_read_max=1 << 20, burst_seconds=5))
    assert limited["limits"] == {"iops-write": 300, "bps-read-max": 1 << 20, "bps-read-max-length": 5}
