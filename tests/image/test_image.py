"""The container image, built from the Dockerfile and run: its own Python, csi-qsd and QSD.

The image is built with scripts/build-image.sh (podman, a Debian 13 base made
with mmdebstrap: no image registry needed) into a container storage of the
test's own, so nothing is left behind in the host's. It is then run without
`podman run`, which needs setrlimit rights some hosts refuse:

* single commands with `buildah run --isolation chroot`;
* the driver in a chroot of the image's root filesystem (`buildah mount`),
  inside a private mount namespace with /dev, /proc and /sys bound in and
  the state and kubelet directories bound from the host, as the DaemonSet's
  privileged pod has them. Every mount the driver makes stays in that
  namespace and goes away with it, even when a test fails halfway.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from csi_qsd import __version__
from csi_qsd.sys import mounts

REPO_ROOT = Path(__file__).resolve().parents[2]
TAG = "localhost/csi-qsd:image-test"
MIN_QEMU = (10, 0, 8)  # the FUSE export fix; DESIGN.md, "QEMU >= 10.0.8 for QSD"


def run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run a host command; its stdout, or a failure that shows what it printed."""
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise AssertionError(f"{argv} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def version(text: str) -> tuple[int, ...]:
    match = re.search(r"version (\d+)\.(\d+)\.(\d+)", text)
    assert match, text
    return tuple(int(part) for part in match.groups())


@dataclass
class Store:
    """A container storage of our own: podman and buildah are always pointed at it explicitly."""

    path: Path

    def __post_init__(self) -> None:
        (self.path / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.graph}"\nrunroot = "{self.runroot}"\n'
        )

    @property
    def graph(self) -> Path:
        return self.path / "graph"

    @property
    def runroot(self) -> Path:
        return self.path / "run"

    @property
    def env(self) -> dict[str, str]:
        """For scripts/build-image.sh, which calls podman without flags."""
        return dict(os.environ, CONTAINERS_STORAGE_CONF=str(self.path / "storage.conf"))

    def podman(self, *args: str, timeout: float = 120) -> str:
        return run(["podman", "--root", str(self.graph), "--runroot", str(self.runroot), *args],
                   env=self.env, timeout=timeout)

    def buildah(self, *args: str, timeout: float = 120) -> str:
        return run(["buildah", "--root", str(self.graph), "--runroot", str(self.runroot), *args],
                   env=self.env, timeout=timeout)

    def remove(self) -> None:
        """Every container and image in it, then the mounts containers/storage keeps, then the files."""
        for remove in (lambda: self.buildah("rm", "--all"), lambda: self.podman("rmi", "--all", "--force")):
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                remove()
        entries = [e for e in mounts.mount_table() if self.path in e.mount_point.parents]
        for entry in sorted(entries, key=lambda e: len(e.mount_point.parts), reverse=True):
            subprocess.run(["umount", "--lazy", str(entry.mount_point)], capture_output=True, check=False)
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class Image:
    store: Store
    env: dict[str, str]
    entrypoint: list[str]


@dataclass
class Container:
    """A working container from the image and its root filesystem, mounted on the host."""

    store: Store
    name: str
    rootfs: Path

    def run(self, *argv: str) -> str:
        return self.store.buildah("run", "--isolation", "chroot", self.name, "--", *argv)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    """The Dockerfile built by scripts/build-image.sh, as a normal build of the image would be."""
    store = Store(tmp_path_factory.mktemp("containers"))
    try:
        run(["bash", str(REPO_ROOT / "scripts" / "build-image.sh"), TAG], env=store.env, timeout=600)
        (config,) = json.loads(store.podman("image", "inspect", TAG))
        env = dict(item.split("=", 1) for item in config["Config"]["Env"])
        yield Image(store, env, config["Config"]["Entrypoint"])
    finally:
        store.remove()


@pytest.fixture
def container(image: Image) -> Iterator[Container]:
    name = f"csi-qsd-test-{uuid.uuid4().hex[:8]}"
    image.store.buildah("from", "--pull=never", "--name", name, TAG)
    try:
        rootfs = Path(image.store.buildah("mount", name).strip())
        yield Container(image.store, name, rootfs)
    finally:
        with contextlib.suppress(AssertionError):
            image.store.buildah("umount", name)
        image.store.buildah("rm", name)


class Namespace:
    """A private mount namespace holding the image's root filesystem, ready to chroot into.

    Held open by one process; whatever runs in it is killed on exit, loop
    devices over files in it are detached, and the namespace goes away with
    its last process, taking every mount made in it along.
    """

    def __init__(self, rootfs: Path, env: dict[str, str], binds: dict[str, Path]) -> None:
        self.rootfs = rootfs
        self.env = env
        self.binds = binds
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "echo ready && exec cat >/dev/null"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def __enter__(self) -> Namespace:
        try:
            assert self.holder.stdout is not None
            # Printed after unshare made every mount private: nothing bound from here on reaches the host.
            assert self.holder.stdout.readline().strip() == "ready"
            self.holder.stdout.close()
            root = str(self.rootfs)
            script = [
                f"mount --rbind /dev {root}/dev",
                f"mount -t proc proc {root}/proc",
                f"mount --rbind /sys {root}/sys",
            ]
            for inside, outside in self.binds.items():
                script += [f"mkdir -p {root}{inside}", f"mount --bind {outside} {root}{inside}"]
            self.host(" && ".join(script))
        except BaseException:
            self.__exit__()
            raise
        return self

    def host(self, script: str) -> str:
        """A shell script with the host's tools, in the namespace but outside the chroot."""
        return run(["nsenter", "--target", str(self.holder.pid), "--mount", "--", "sh", "-c", script])

    def argv(self, *argv: str) -> list[str]:
        """`argv` run by the image: its root, its PATH and environment."""
        return ["nsenter", "--target", str(self.holder.pid), "--mount", "--",
                shutil.which("chroot") or "chroot", str(self.rootfs), *argv]

    def run(self, *argv: str, timeout: float = 60) -> str:
        return run(self.argv(*argv), env=self.env, timeout=timeout)

    def loop_devices(self) -> dict[str, tuple[Path, bool]]:
        """Loop devices over files inside the image's root: name → (backing file, direct I/O)."""
        out = self.host(
            "for d in /sys/block/loop*/loop; do [ -e $d/backing_file ] && "
            "printf '%s\\t%s\\t%s\\n' ${d%/loop} \"$(cat $d/backing_file)\" \"$(cat $d/dio)\"; done; true"
        )
        found = {}
        for line in out.splitlines():
            sys_dir, backing, dio = line.split("\t")
            if Path(backing).is_relative_to(self.rootfs):
                found[Path(sys_dir).name] = (Path(backing), dio == "1")
        return found

    def processes(self) -> list[int]:
        """Every process in the namespace but its holder."""
        ns = os.readlink(f"/proc/{self.holder.pid}/ns/mnt")
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != self.holder.pid:
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "mnt") == ns:
                        found.append(int(entry.name))
        return found

    def __exit__(self, *exc: object) -> None:
        try:
            if self.holder.poll() is None:
                for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                    pids = self.processes()
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, sig)
                    deadline = time.monotonic() + grace
                    while pids and time.monotonic() < deadline:
                        pids = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
                        time.sleep(0.05)
                # A device still mounted in the namespace is only marked to detach on its last close,
                # which is when the namespace goes.
                for name in self.loop_devices():
                    subprocess.run(["losetup", "--detach", f"/dev/{name}"], capture_output=True, check=False)
        finally:
            assert self.holder.stdin is not None
            self.holder.stdin.close()
            self.holder.wait(timeout=30)


def test_image_runs_csi_qsd_and_qemu_10(image: Image, container: Container) -> None:
    assert image.entrypoint == ["csi-qsd"]
    assert container.run("csi-qsd", "--version").strip() == f"csi-qsd {__version__}"
    assert container.run("sh", "-c", "command -v csi-qsd").strip() == "/opt/csi-qsd/bin/csi-qsd"
    for tool in ("qemu-storage-daemon", "qemu-img"):
        out = container.run(tool, "--version")
        assert version(out) >= MIN_QEMU, f"{tool} in the image: {out.splitlines()[0]}"
    # The tools the driver calls, from the image's own packages.
    tools = ("losetup", "mount", "umount", "blkid", "fsfreeze", "mkfs.ext4", "resize2fs", "mkfs.xfs",
             "xfs_growfs", "fusermount3")
    container.run("sh", "-c", " && ".join(f"command -v {tool} >/dev/null" for tool in tools))
    # No /etc/mtab, so libfuse does not fork QSD to run `mount -f` for each FUSE export (Dockerfile).
    assert not os.path.lexists(container.rootfs / "etc" / "mtab")


def test_volume_lifecycle_in_the_image(image: Image, container: Container, tmp_path: Path) -> None:
    """create, stage (ext4 and xfs), publish, write, read back, again after a restage, delete."""
    state, kubelet = tmp_path / "state", tmp_path / "kubelet"
    for path in (state, kubelet):
        path.mkdir()
    log = tmp_path / "serve.log"
    binds = {"/var/lib/csi-qsd": state, "/var/lib/kubelet": kubelet}
    with Namespace(container.rootfs, image.env, binds) as ns, open(log, "wb") as stderr:
        csi_qsd = image.entrypoint
        serve = subprocess.Popen(ns.argv(*csi_qsd, "serve", "--node-id", "image-test"), env=ns.env,
                                 stdout=subprocess.PIPE, stderr=stderr)
        try:
            assert serve.stdout is not None
            ready, _, _ = select.select([serve.stdout], [], [], 60)
            line = serve.stdout.readline().decode() if ready else ""
            assert "listening on unix:///var/lib/csi-qsd/csi.sock" in line, f"{line!r}\n{log.read_text()[-4000:]}"

            def volume(*args: str) -> str:
                return ns.run(*csi_qsd, "volume", *args)

            assert json.loads(volume("info", "-o", "json"))["ready"] is True
            for fs_type in ("ext4", "xfs"):
                staging = f"/var/lib/kubelet/plugins/staging/{fs_type}"
                target = f"/var/lib/kubelet/pods/{fs_type}/volume"
                (kubelet / staging.removeprefix("/var/lib/kubelet/")).mkdir(parents=True)
                (kubelet / f"pods/{fs_type}").mkdir(parents=True)
                # 512 MiB: mkfs.xfs refuses filesystems under 300 MB.
                vid = json.loads(volume("create", f"image-{fs_type}", "--size", "512Mi", "-o", "json"))["volume_id"]
                volume("stage", vid, staging, "--fs-type", fs_type)
                # QSD >= 10.0.8 in the image: the driver takes the direct-I/O loop device.
                loops = ns.loop_devices()
                assert loops and all(direct for _, direct in loops.values()), loops
                volume("publish", vid, staging, target)
                text = f"written in the image on {fs_type}"
                ns.run("sh", "-c", f"printf '%s' '{text}' > {target}/hello.txt && sync {target}/hello.txt")
                assert ns.run("cat", f"{target}/hello.txt") == text
                assert ns.run("findmnt", "--noheadings", "--output", "FSTYPE", target).strip() == fs_type
                volume("unpublish", vid, target)
                volume("unstage", vid, staging)
                assert not ns.loop_devices()
                volume("stage", vid, staging, "--fs-type", fs_type)
                volume("publish", vid, staging, target)
                assert ns.run("cat", f"{target}/hello.txt") == text
                volume("unpublish", vid, target)
                volume("unstage", vid, staging)
                volume("delete", vid)
            assert volume("list", "-o", "json") == "", "ListVolumes after every delete"
            assert not ns.loop_devices()
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(timeout=30) == 0, log.read_text()[-4000:]
        finally:
            # On failure the namespace kills QSD and whatever else runs in it, then detaches the loop devices.
            if serve.poll() is None:
                serve.kill()
                serve.wait()
            if serve.stdout is not None:
                serve.stdout.close()
