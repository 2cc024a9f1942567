"""deploy/overlays/managed-xfs-pool/ fits together: the plugin manages its pool, and its mount reaches QSD."""

from __future__ import annotations

import posixpath
from pathlib import Path

from csi_qsd.cli import build_parser
from csi_qsd.pool_specs.managed_spec import ManagedPoolSpec
from testing.manifests.kustomize import render
from testing.manifests.objects import DEPLOY_DIR, Obj, container, one, readme_overlay, resolve_mount

OVERLAY = DEPLOY_DIR / "overlays" / "managed-xfs-pool"


def pod_of(objects: list[Obj]) -> Obj:
    spec: Obj = one(objects, "DaemonSet", "csi-qsd-node")["spec"]["template"]["spec"]
    return spec


def test_the_plugin_manages_an_xfs_pool_and_qsd_sees_its_mount() -> None:
    pod = pod_of(render(OVERLAY))
    plugin, qsd = container(pod, "csi-qsd"), container(pod, "qsd")
    args = build_parser().parse_args(plugin["args"])
    assert args.managed_pool == ManagedPoolSpec("xfs", 200 << 30)
    pool = args.pool_dir or posixpath.join(args.state_dir, "pool")
    # The plugin mounts the XFS at the pool directory: the mount must leave its container (Bidirectional)
    # and reach QSD's, which opens the images there at the same path, on the same host directory.
    made, volume, relative = resolve_mount(pod, plugin, pool)
    assert made.get("mountPropagation") == "Bidirectional" and relative != "."
    seen, qsd_volume, qsd_relative = resolve_mount(pod, qsd, pool)
    assert seen.get("mountPropagation") in ("Bidirectional", "HostToContainer")
    assert (volume["name"], relative) == (qsd_volume["name"], qsd_relative)
    # The pool's file lies in the state directory, on the same host directory.
    image = posixpath.join(args.state_dir, "managed-pool", "xfs.img")
    assert resolve_mount(pod, plugin, image)[1]["name"] == volume["name"]


def test_the_base_keeps_a_plain_pool() -> None:
    pod = pod_of(render(DEPLOY_DIR))
    assert build_parser().parse_args(container(pod, "csi-qsd")["args"]).managed_pool is None


def test_the_readme_overlay_sets_a_size_of_its_own(tmp_path: Path) -> None:
    overlay = readme_overlay(DEPLOY_DIR / "README.md", "my-pool", OVERLAY, tmp_path)
    args = build_parser().parse_args(container(pod_of(render(overlay)), "csi-qsd")["args"])
    assert args.managed_pool == ManagedPoolSpec("xfs", 500 << 30, sparse=True)
