"""The runtime directory: private files on tmpfs that live only while QEMU loads them.

QEMU reads x509 credentials, a private key among them, from files in one
directory: qemu-nbd once when it starts, QSD once when a `tls-creds-x509`
object is added. Measured on QEMU 10.0.13: after qemu-nbd's `--fork`
returned and after QSD's `object-add` answered, removing the directory
changed nothing: new TLS links opened, an NBD node opened before a restart
of its server reconnected and read, and an `object-del` + `object-add` from
another directory (a reload) worked, that directory removed at once; an
`object-add` naming a directory that is gone is refused ("Unable to access
credentials"). So no key file outlives the load: each load writes a
directory of its own here (0700, files 0600) and removes it as soon as QEMU
has answered, whether the load worked or not.

The directory should be on tmpfs, where a key never reaches a disk:
deploy/node.yaml mounts an emptyDir of medium Memory at the same path in
the plugin's container and in QSD's, which reads the path QMP names in its
own mount namespace. It belongs to one driver, as its state directory
does: what a killed load left there is removed at start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_RUNTIME_DIR = Path("/run/csi-qsd")
SCRATCH_PREFIX = "tls-"
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def prepare(runtime_dir: Path) -> list[Path]:
    """Make `runtime_dir` (mode 0700) and remove what a load cut off left in it; the paths removed.

    Raises OSError.
    """
    runtime_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(runtime_dir, 0o700)
    left = sorted(runtime_dir.glob(SCRATCH_PREFIX + "*"))
    for path in left:
        remove(path)
    return left


def remove(path: Path) -> None:
    """Remove a file or directory tree at `path` (never following a link out of it); nothing if absent."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def new_scratch(runtime_dir: Path) -> Path:
    """A new private directory (0700) under `runtime_dir`, for one load; `remove` it once QEMU answered.

    Raises OSError.
    """
    runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=runtime_dir))
