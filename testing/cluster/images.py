"""Container images without a registry: `FROM scratch` images written as OCI archives.

A static binary (a sidecar, pause, busybox) needs no base image and no build
tool: its image is one layer holding the files, a config naming the
entrypoint, and a manifest. `ctr images import` takes the archive into the
cluster's containerd, named by the `io.containerd.image.name` annotation.
Written byte-for-byte reproducibly (fixed mtimes, sorted entries), so the
same files give the same image ID and a cache can key on it.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class ImageFile:
    """One file of a scratch image: where it lives in the image and where its bytes come from."""

    path: str
    source: Path | None = None
    data: bytes = b""
    mode: int = 0o755
    symlink: str = ""
    directory: bool = False


@dataclass(frozen=True)
class ScratchImage:
    """A `FROM scratch` image: a name, its files and how it starts."""

    name: str
    files: tuple[ImageFile, ...]
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ("PATH=/usr/local/bin:/usr/bin:/bin",)
    labels: dict[str, str] = field(default_factory=dict)


def _tar_layer(files: tuple[ImageFile, ...]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for f in sorted(files, key=lambda f: f.path):
            rel = PurePosixPath(f.path.lstrip("/"))
            for parent in reversed(rel.parents[:-1]):
                if str(parent) not in dirs:
                    dirs.add(str(parent))
                    info = tarfile.TarInfo(str(parent))
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                    tar.addfile(info)
            info = tarfile.TarInfo(str(rel))
            info.mtime, info.mode = 0, f.mode
            if f.directory:
                dirs.add(str(rel))
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            if f.symlink:
                info.type, info.linkname = tarfile.SYMTYPE, f.symlink
                tar.addfile(info)
                continue
            data = f.source.read_bytes() if f.source is not None else f.data
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def write_oci_archive(image: ScratchImage, out: Path) -> str:
    """Write `image` as an OCI archive at `out`; return its manifest digest (the image's identity)."""
    layer = _tar_layer(image.files)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": list(image.entrypoint),
            "Cmd": list(image.cmd) or None,
            "Env": list(image.env),
            "Labels": image.labels or None,
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        layout = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
        info = tarfile.TarInfo("oci-layout")
        info.size, info.mtime = len(layout), 0
        tar.addfile(info, io.BytesIO(layout))
        config_digest = _blob(tar, config_bytes)
        layer_digest = _blob(tar, layer)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": layer_digest, "size": len(layer)}],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = _blob(tar, manifest_bytes)
        index = {
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest, "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": image.name,
                                "org.opencontainers.image.ref.name": image.name.rsplit(":", 1)[-1]},
            }],
        }
        index_bytes = json.dumps(index, sort_keys=True).encode()
        info = tarfile.TarInfo("index.json")
        info.size, info.mtime = len(index_bytes), 0
        tar.addfile(info, io.BytesIO(index_bytes))
    tmp.rename(out)
    return manifest_digest
