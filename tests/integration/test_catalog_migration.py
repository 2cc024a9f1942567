"""A catalog written by the previous release (schema 1) opens, migrates, reconciles and serves its volumes.

The old catalog is made the way release 0.1.0 made it: its own DDL
(tests/data/catalog_v1.sql) and positional inserts, with real images in the
pool — a volume on a snapshot chain, published as a filesystem when the
driver stopped, and a raw block volume.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path

from csi_qsd import validate
from csi_qsd.catalog import SCHEMA_VERSION
from csi_qsd.params import VolumeParameters
from testing.harness import Sandbox, in_process_driver, sandbox

MIB = 1 << 20
V1_SCHEMA = Path(__file__).parent.parent / "data" / "catalog_v1.sql"


def qemu_img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True, env={**os.environ, "LC_ALL": "C"})


def write_v1_catalog(box: Sandbox) -> dict[str, str]:
    """Images and a schema-1 catalog as release 0.1.0 left them; returns the volume IDs by name."""
    pool = box.state_dir / "pool"
    pool.mkdir(parents=True)
    fs_id, blk_id, snap_id = validate.new_volume_id(), validate.new_volume_id(), validate.new_snapshot_id()
    base, top, raw = pool / f"{fs_id}.qcow2", pool / f"{fs_id}.1.qcow2", pool / f"{blk_id}.raw"
    qemu_img("create", "-q", "-f", "qcow2", str(base), str(64 * MIB))
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(make_tree(box.root / "seed")), str(box.root / "fs.raw"),
                    "64M"], check=True, capture_output=True)
    qemu_img("convert", "-n", "-f", "raw", "-O", "qcow2", str(box.root / "fs.raw"), str(base))
    qemu_img("create", "-q", "-f", "qcow2", "-b", base.name, "-F", "qcow2", str(top), str(64 * MIB))
    qemu_img("create", "-q", "-f", "raw", str(raw), str(32 * MIB))
    with open(raw, "r+b") as f:
        f.write(b"raw volume bytes")
    fs_params = VolumeParameters().to_json()
    raw_params = json.loads(VolumeParameters().to_json())
    raw_params["format"] = "raw"
    db = sqlite3.connect(box.state_dir / "catalog.db", isolation_level=None)
    db.executescript(V1_SCHEMA.read_text())
    db.execute("PRAGMA user_version=1")
    now = time.time()
    db.execute("INSERT INTO volumes (id, name, capacity, params, image, state, created_at, backing, generation,"
               " source) VALUES (?,?,?,?,?,?,?,?,?,?)",
               (fs_id, "pvc-old-fs", 64 * MIB, fs_params, str(top), "ready", now, str(base), 1, ""))
    db.execute("INSERT INTO volumes (id, name, capacity, params, image, state, created_at, backing, generation,"
               " source) VALUES (?,?,?,?,?,?,?,?,?,?)",
               (blk_id, "pvc-old-blk", 32 * MIB, json.dumps(raw_params), str(raw), "ready", now, "", 0, ""))
    db.execute("INSERT INTO snapshots VALUES (?,?,?,?,?,?,?,?,?,?,?)",
               (snap_id, "snap-old", fs_id, str(base), "", 64 * MIB, now, "ready", 0, "", ""))
    # Staged and published when the old driver stopped; the new one finds no QSD and rebuilds both.
    staging, target = box.staging("old"), box.target("old")
    db.execute("INSERT INTO stages VALUES (?,?,?,?,?,?,?,?)",
               (fs_id, str(staging), "mount", "ext4", "[]", "", "staged", "/dev/loop999"))
    db.execute("INSERT INTO publishes VALUES (?,?,?,?,?,?)", (str(target), fs_id, 0, "[]", "published", ""))
    db.close()
    return {"fs": fs_id, "blk": blk_id, "snap": snap_id}


def make_tree(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "hello.txt").write_text("written under schema 1\n")
    return root


async def test_schema_1_catalog_opens_reconciles_and_serves() -> None:
    with sandbox() as box:
        ids = write_v1_catalog(box)
        async with in_process_driver(box) as (driver, csi):
            db = sqlite3.connect(box.state_dir / "catalog.db")
            assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
            assert {row[0] for row in db.execute("SELECT pool FROM volumes")} == {"default"}
            db.close()
            # The published volume was rebuilt: its file is readable through the old target path.
            target = box.target("old")
            assert (target / "hello.txt").read_text() == "written under schema 1\n"
            listed = {v.volume_id for v in await csi.list_volumes()}
            assert listed == {ids["fs"], ids["blk"]}
            # Every call works on the old volumes: write, unpublish, unstage, restore, delete.
            (target / "new.txt").write_text("written under schema 2\n")
            os.sync()
            await csi.unpublish(ids["fs"], str(target))
            await csi.unstage(ids["fs"], str(box.staging("old")))
            restored = (await csi.create_volume("pvc-restored", 64 * MIB, from_snapshot=ids["snap"])).volume_id
            staging, pod = box.staging("r"), box.target("r")
            await csi.stage(restored, str(staging))
            await csi.publish(restored, str(staging), str(pod))
            assert (pod / "hello.txt").read_text() == "written under schema 1\n"
            assert not (pod / "new.txt").exists()
            await csi.unpublish(restored, str(pod))
            await csi.unstage(restored, str(staging))
            staging, pod = box.staging("b"), box.target("b")
            await csi.stage(ids["blk"], str(staging), block=True)
            await csi.publish(ids["blk"], str(staging), str(pod), block=True)
            with open(pod, "rb") as f:
                assert f.read(16) == b"raw volume bytes"
            await csi.unpublish(ids["blk"], str(pod))
            await csi.unstage(ids["blk"], str(staging))
            for vid in (restored, ids["fs"], ids["blk"]):
                await csi.delete_volume(vid)
            assert driver.catalog.usable()
