"""Changed-block granularity: the StorageClass parameter, and the qcow2 layout that gives it.

Changed-block tracking reports what the images between two snapshots hold,
so its granularity is the unit in which qcow2 allocates: a cluster, or with
extended L2 entries (`extended_l2=on`) one of its 32 subclusters, each
allocated on its own in an overlay and reported on its own by block status
and `qemu-img map`. A granularity G maps to:

* G of 64 KiB (the default) up to 2 MiB (qcow2's largest cluster): plain
  clusters of G, the layout every volume had before this parameter existed,
  so a catalog row without it still describes its images;
* G of 4 KiB up to 32 KiB: clusters of 32·G (128 KiB to 1 MiB) with
  extended L2 entries, so G is a subcluster.

Below 4 KiB nothing is gained: filesystems and guests write whole 4 KiB
pages, and a range finer than what was written tells a backup nothing more.
Every image of a volume's chain (the first image, each snapshot's overlay,
a restore's or clone's overlay) is created with its volume's layout, so a
delta between two of its snapshots is aligned to its granularity.
"""

from __future__ import annotations

from csi_qsd.errors import InvalidArgument

KIB = 1 << 10
MIB = 1 << 20
DEFAULT = 64 * KIB
MINIMUM = 4 * KIB
MAXIMUM = 2 * MIB  # qcow2's largest cluster
SUBCLUSTERS = 32  # per cluster with extended L2 entries (qcow2 spec)
# Backups hold ranges of any granularity above: 4 KiB subclusters let each be written alone.
BACKUP_OPTIONS = f"cluster_size={SUBCLUSTERS * MINIMUM},extended_l2=on"

_SUFFIXES = {"Ki": KIB, "Mi": MIB}


def parse(key: str, value: str) -> int:
    """A granularity in bytes from '4096', '4Ki' or '2Mi': a power of two, 4 KiB to 2 MiB.

    Raises InvalidArgument naming `key`.
    """
    digits, unit = value, 1
    for suffix, factor in _SUFFIXES.items():
        if value.endswith(suffix):
            digits, unit = value[: -len(suffix)], factor
    # Plain ASCII digits only: int() would also take ' 5', '+5', '5_0' or '٥'.
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 10):
        raise InvalidArgument(f"parameter {key!r} must be bytes as digits, optionally with Ki or Mi "
                              f"(e.g. '4Ki', '64Ki'), got {value!r}")
    number = int(digits, 10) * unit
    if number & (number - 1) or not MINIMUM <= number <= MAXIMUM:
        raise InvalidArgument(f"parameter {key!r} is {value!r}; allowed: a power of two from 4Ki to 2Mi")
    return number


def qcow2_options(granularity: int) -> list[str]:
    """The `qemu-img create -o` options of a qcow2 image whose allocation unit is `granularity`."""
    if granularity >= DEFAULT:
        return [] if granularity == DEFAULT else [f"cluster_size={granularity}"]
    return [f"cluster_size={SUBCLUSTERS * granularity}", "extended_l2=on"]
