"""Everything the cluster runs, built here and cached by version: binaries, images, CRDs.

Kubernetes, etcd, the CSI sidecars and Helm are built from their Go modules (the
scripts beside this file), except node-driver-registrar and livenessprobe,
whose release builds come from `../shared/bin` (`prebuilt`); each sidecar,
pause and a busybox become `FROM scratch` images; the driver's image is
built from this checkout's Dockerfile (`scripts/build-image.sh`), cached by
a digest of the files that go into it. The cache lives in `$CSI_QSD_CACHE_DIR/cluster` (default
`~/.cache/csi-qsd/cluster`), so a second run builds nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from testing import shared_bin
from testing.cluster import prebuilt, versions
from testing.cluster.images import ImageFile, ScratchImage, write_oci_archive

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

DRIVER_IMAGE = "ghcr.io/csi-qsd/csi-qsd:0.1.0"
# The driver's image with one more label: another image (its own ID) for the in-place upgrade test.
UPGRADE_IMAGE = "ghcr.io/csi-qsd/csi-qsd:0.1.0-upgrade"


def cache_root() -> Path:
    explicit = os.environ.get("CSI_QSD_CACHE_DIR")
    base = Path(explicit).expanduser() if explicit else Path.home() / ".cache" / "csi-qsd"
    return base / "cluster"


@dataclass(frozen=True)
class Built:
    """What a cluster run needs: the Kubernetes binaries' directory, image archives, the snapshot CRDs and controller,
    and which upstream release builds the registrar's and livenessprobe's images hold."""

    kubernetes: Path
    images: tuple[Path, ...]
    snapshot_crds: Path
    snapshot_controller_manifests: Path
    releases: tuple[prebuilt.Release, ...] = ()
    helm: Path | None = None


def _run(argv: list[str], env: dict[str, str] | None = None, **kwargs: object) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C", **(env or {})},  # type: ignore[call-overload]
                            **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return str(result.stdout)


def _module_dir(module: str, version: str) -> Path:
    answer = json.loads(_run(["go", "mod", "download", "-json", f"{module}@{version}"], cwd="/"))
    if "Error" in answer:
        raise RuntimeError(f"go mod download {module}@{version}: {answer['Error']}")
    return Path(answer["Dir"])


def kubernetes_binaries(root: Path) -> Path:
    out = root / f"kubernetes-{versions.KUBERNETES}"
    _run(["bash", str(REPO / "scripts" / "build-kubernetes.sh"), versions.KUBERNETES, str(out), *versions.KUBERNETES_BINARIES])
    return out


def helm_binary(root: Path) -> Path:
    """Helm at `versions.HELM`, built from its module (cmd/helm)."""
    out = root / f"helm-{versions.HELM}"
    _run(["bash", str(REPO / "scripts" / "build-go-module.sh"), versions.HELM_MODULE, versions.HELM, str(out),
          "cmd/helm"], env={"GO_EXTRA_LDFLAGS": versions.HELM_LDFLAGS})
    return out / "helm"


def _scratch(root: Path, image: ScratchImage) -> Path:
    key = hashlib.sha256(repr((image.name, image.entrypoint, [
        (f.path, f.symlink, f.mode, f.directory, f.source.stat().st_mtime_ns if f.source else f.data)
        for f in image.files
    ])).encode()).hexdigest()[:16]
    stem = image.name.replace('/', '_').replace(':', '_')
    archive = root / "images" / f"{stem}-{key}.tar"
    if not archive.exists():
        archive.parent.mkdir(parents=True, exist_ok=True)
        for stale in archive.parent.glob(f"{stem}-*.tar"):
            stale.unlink()
        write_oci_archive(image, archive)
    return archive


def sidecar_images(root: Path) -> list[Path]:
    out = root / "sidecars"
    archives = []
    for sidecar in versions.SIDECARS:
        _run(["bash", str(REPO / "scripts" / "build-go-module.sh"), sidecar.module, sidecar.version,
              str(out / sidecar.version), sidecar.package])
        name = sidecar.package.rsplit("/", 1)[-1]
        binary = out / sidecar.version / name
        archives.append(_scratch(root, ScratchImage(sidecar.image, (ImageFile(f"/{name}", binary),), (f"/{name}",))))
    return archives


def prebuilt_images(root: Path, releases: list[prebuilt.Release]) -> list[Path]:
    """The registrar's and livenessprobe's release builds, each alone in a scratch image under node.yaml's name."""
    return [_scratch(root, ScratchImage(r.image, (ImageFile(f"/{r.sidecar.binary}", r.path),), (f"/{r.sidecar.binary}",)))
            for r in releases]


def pause_images(root: Path) -> list[Path]:
    """Kubernetes' pause under the name the sandboxes and examples use, and the one the e2e suite asks for."""
    binary = root / f"pause-{versions.KUBERNETES}"
    if not binary.exists():
        source = _module_dir("k8s.io/kubernetes", versions.KUBERNETES) / "build" / "pause" / "linux" / "pause.c"
        _run(["gcc", "-Os", "-static", "-DVERSION=" + versions.KUBERNETES, "-o", f"{binary}.tmp", str(source)])
        Path(f"{binary}.tmp").rename(binary)
    return [_scratch(root, ScratchImage(name, (ImageFile("/pause", binary),), ("/pause",)))
            for name in (versions.PAUSE_IMAGE, versions.E2E_PAUSE_IMAGE)]


def _busybox_files() -> list[ImageFile]:
    """Debian's busybox-static with a link per applet, and a /tmp anyone may write."""
    busybox = Path("/bin/busybox")
    applets = _run([str(busybox), "--list"]).split()
    files = [ImageFile("/bin/busybox", busybox), ImageFile("/tmp", mode=0o1777, directory=True)]
    return files + [ImageFile(f"/bin/{a}", symlink="busybox") for a in applets if a != "busybox"]


def busybox_image(root: Path) -> Path:
    """Debian's busybox-static as the image the examples name, so they run unchanged."""
    files = _busybox_files()
    files.append(ImageFile("/etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n",
                           mode=0o644))
    files.append(ImageFile("/etc/group", data=b"root:x:0:\nnogroup:x:65534:\n", mode=0o644))
    return _scratch(root, ScratchImage(versions.BUSYBOX_IMAGE, tuple(files), ("/bin/sh",)))


def e2e_test_images(root: Path, kubernetes: Path) -> list[Path]:
    """The e2e suite's test images, built here: busybox-static for its busybox and nginx, plus agnhost.

    The storage tests give the nginx image only shell commands, and run `nsenter` and shell tools in
    agnhost's host-exec pods: busybox's applets serve them (jessie-dnsutils is `jessie_dnsutils_image`).
    """
    files = _busybox_files()
    agnhost = [*files, ImageFile("/agnhost", kubernetes / "agnhost")]
    shells = (versions.E2E_BUSYBOX_IMAGE, versions.E2E_NGINX_IMAGE)
    return [*(_scratch(root, ScratchImage(name, tuple(files), ("/bin/sh",))) for name in shells),
            _scratch(root, ScratchImage(versions.E2E_AGNHOST_IMAGE, tuple(agnhost), ("/agnhost",)))]


MOUNTPOINT_SCRIPT = b"""#!/bin/sh
[ "$1" = -q ] && shift
dir=$(cd "$1" 2>/dev/null && pwd -P) || exit 1
awk -v d="$dir" '$5 == d { found = 1 } END { exit !found }' /proc/self/mountinfo
"""


def kubectl_image(root: Path, kubernetes: Path) -> Path:
    """busybox and the cluster's own kubectl, under the name the hotplug example's node agent uses."""
    files = [*_busybox_files(), ImageFile("/usr/bin/kubectl", kubernetes / "kubectl")]
    # Debian's busybox has no `mountpoint` applet; the example's agent asks `mountpoint -q DIR`.
    files.append(ImageFile("/usr/bin/mountpoint", data=MOUNTPOINT_SCRIPT, mode=0o755))
    return _scratch(root, ScratchImage(versions.KUBECTL_IMAGE, tuple(files), ("/usr/bin/kubectl",)))


def _source_digest() -> str:
    """A digest of the files the driver's image is built from (tracked and new files of this checkout).

    Not the tests, docs, chart or Markdown: the image's build stage copies them but installs none.
    """
    names = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).split("\0")
    digest = hashlib.sha256()
    for name in sorted(n for n in names if n):
        path = REPO / name
        if path.is_file() and not name.startswith(("e2e/", "tests/", "testing/", "docs/", "charts/")) and not name.endswith(".md"):
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def driver_images(root: Path) -> Path:
    """The driver's image from the Dockerfile, and the in-place upgrade test's image derived from it."""
    archive = root / "images" / f"csi-qsd-{_source_digest()}-u.tar"
    if archive.exists():
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    _run(["bash", str(REPO / "scripts" / "build-image.sh"), DRIVER_IMAGE])
    work = root / "images" / "derived"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "Containerfile").write_text(f'FROM {DRIVER_IMAGE}\nLABEL io.csi-qsd.test="in-place upgrade"\n')
    _run(["podman", "build", "--isolation", "chroot", "--quiet", "--tag", UPGRADE_IMAGE, str(work)])
    for stale in (root / "images").glob("csi-qsd-*.tar"):
        stale.unlink()
    tmp = archive.with_name(archive.name + ".tmp")
    tmp.unlink(missing_ok=True)
    _run(["podman", "save", "--multi-image-archive", "--format", "docker-archive", "--output", str(tmp),
          DRIVER_IMAGE, UPGRADE_IMAGE])
    tmp.rename(archive)
    shutil.rmtree(work, ignore_errors=True)
    return archive


QEMU_IMAGE = "localhost/csi-qsd-test/qemu:trixie"


def _debian_image(root: Path, name: str, stem: str, recipe: str, files: tuple[Path, ...] = ()) -> Path:
    """An image built with podman from `recipe` (on the base image scripts/build-image.sh makes, which must
    have run first) with `files` in its context, cached by the recipe and the files' bytes."""
    key = hashlib.sha256(recipe.encode())
    for source in files:
        key.update(source.name.encode() + b"\0" + hashlib.sha256(source.read_bytes()).digest())
    archive = root / "images" / f"{stem}-{key.hexdigest()[:16]}.tar"
    if archive.exists():
        return archive
    work = root / "images" / f"{stem}-build"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "Containerfile").write_text(recipe)
    for source in files:
        shutil.copy2(source, work / source.name)
    _run(["podman", "build", "--isolation", "chroot", "--quiet", "--tag", name, str(work)])
    for stale in (root / "images").glob(f"{stem}-*.tar"):
        stale.unlink()
    tmp = archive.with_name(archive.name + ".tmp")
    tmp.unlink(missing_ok=True)
    _run(["podman", "save", "--format", "docker-archive", "--output", str(tmp), name])
    tmp.rename(archive)
    shutil.rmtree(work, ignore_errors=True)
    return archive


def qemu_image(root: Path) -> Path:
    """Debian 13's QEMU (and socat, to speak QMP) in an image, for VM pods (guest kernel from a hostPath)."""
    return _debian_image(root, QEMU_IMAGE, "qemu", (
        "FROM localhost/csi-qsd-base:trixie\n"
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        "qemu-system-x86 socat && rm -rf /var/lib/apt/lists/*\n"
        'ENTRYPOINT ["qemu-system-x86_64"]\n'))


HOSTPATH_IMAGE = "localhost/csi-qsd-test/hostpathplugin:v1.18.0"  # testing/cluster/hostpath/node.yaml's


def hostpath_image(root: Path) -> Path | None:
    """csi-driver-host-path's release build from ../shared/bin on Debian (it runs mount, losetup and fallocate),
    for side-by-side runs; None without the binary. Raises ValueError when its tag is not the image's."""
    binary = shared_bin.find("hostpathplugin")
    release = shared_bin.release("hostpathplugin")
    if binary is None or release is None:
        return None
    prebuilt.check_tag(HOSTPATH_IMAGE, release[1], str(binary))
    return _debian_image(root, HOSTPATH_IMAGE, "hostpathplugin", (
        "FROM localhost/csi-qsd-base:trixie\n"
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        "mount util-linux && rm -rf /var/lib/apt/lists/*\n"
        "COPY hostpathplugin /hostpathplugin\n"
        'ENTRYPOINT ["/hostpathplugin"]\n'), (binary,))


def jessie_dnsutils_image(root: Path) -> Path:
    """The e2e suite's jessie-dnsutils, a Debian with GNU coreutils: its multiVolume tests run GNU dd's
    `oflag=nocache`, which busybox lacks."""
    return _debian_image(root, versions.E2E_JESSIE_IMAGE, "jessie-dnsutils",
                         "FROM localhost/csi-qsd-base:trixie\nCMD [\"/bin/sh\"]\n")


def snapshot_crds() -> Path:
    return _module_dir(*versions.SNAPSHOT_CLIENT_MODULE) / "config" / "crd"


def snapshot_controller_manifests() -> Path:
    return _module_dir(*versions.SNAPSHOTTER_MODULE) / "deploy" / "kubernetes" / "snapshot-controller"


def build_all(root: Path | None = None) -> Built:
    """Build (or find in the cache) everything a cluster run needs.

    Under a lock on the cache: `scripts/test.sh` starts a build in the
    background while the tests that mostly wait run, and the cluster tier's
    own call then waits for it and finds everything built.
    """
    root = root or cache_root()
    with _locked(root):
        return _build_all(root)


def build_from_modules(root: Path | None = None) -> None:
    """Build (or find in the cache) the part built from Go modules and written as scratch archives.

    What `scripts/test.sh` builds in the background while other tests run:
    no container build, since a podman build's RUN step runs in a mount
    namespace of its own that holds a copy of every mount a test has staged
    (the test's unstage then waits for it). The images built with podman
    follow when the tier starts.
    """
    root = root or cache_root()
    with _locked(root):
        kubernetes = kubernetes_binaries(root)
        pause_images(root)
        busybox_image(root)
        kubectl_image(root, kubernetes)
        sidecar_images(root)
        e2e_test_images(root, kubernetes)
        helm_binary(root)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """The cache's build lock, held while building: a second build waits, then finds everything built."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_all(root: Path) -> Built:
    releases = prebuilt.releases()
    kubernetes = kubernetes_binaries(root)
    images = [*pause_images(root), busybox_image(root), kubectl_image(root, kubernetes), *sidecar_images(root),
              *prebuilt_images(root, releases), driver_images(root), qemu_image(root),
              *e2e_test_images(root, kubernetes), jessie_dnsutils_image(root)]
    hostpath = hostpath_image(root)
    images += [hostpath] if hostpath else []
    return Built(kubernetes, tuple(images), snapshot_crds(), snapshot_controller_manifests(), tuple(releases),
                 helm_binary(root))


if __name__ == "__main__":
    if sys.argv[1:] == ["--from-modules"]:
        build_from_modules()
        print("built from modules", flush=True)
    else:
        print(build_all(), flush=True)
