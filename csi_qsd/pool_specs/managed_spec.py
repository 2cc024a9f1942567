"""The spelling of a managed pool: `--managed-pool KIND:SIZE[,sparse]`, parsed before anything is touched.

A managed pool is the file pool's directory on a filesystem the driver makes
itself, in one file in its state directory (`managed_xfs.py`). Apart from
the pool so the configuration can validate it without importing the pool.
"""

from __future__ import annotations

import dataclasses

from csi_qsd.params import parse_size

KINDS = ("xfs",)
# The file grows in whole MiB: a size the loop device and the filesystem's allocation groups divide evenly.
ALIGNMENT = 1 << 20
# mkfs.xfs (xfsprogs >= 5.19) refuses filesystems smaller than 300 MiB.
MINIMUM = 300 << 20


@dataclasses.dataclass(frozen=True)
class ManagedPoolSpec:
    """The pool's filesystem `kind`, the file's `size` in bytes, and whether the file may leave it unreserved.

    Preallocated (the default), the file takes all of `size` when made and
    again at every start, so a full host filesystem can never fail the pool;
    `sparse`, it takes host space as the pool is written, and a host that
    fills up under it shuts the pool down (docs/tuning.md, measured).
    """

    kind: str
    size: int
    sparse: bool = False

    @property
    def preallocate(self) -> bool:
        return not self.sparse

    @classmethod
    def parse(cls, text: str) -> ManagedPoolSpec:
        """Parse KIND:SIZE[,sparse] (SIZE in bytes or with Ki, Mi, Gi, Ti); raises ValueError naming what is wrong."""
        kind, colon, rest = text.partition(":")
        size_text, _, option = rest.partition(",")
        if not colon or kind not in KINDS:
            raise ValueError(f"--managed-pool {text!r}: expected KIND:SIZE[,sparse] with KIND one of "
                             f"{', '.join(KINDS)}, e.g. xfs:200Gi")
        try:
            size = parse_size(size_text)
        except ValueError:
            raise ValueError(f"--managed-pool {text!r}: SIZE must be bytes or a number with Ki, Mi, Gi or Ti") from None
        if option not in ("", "sparse"):
            raise ValueError(f"--managed-pool {text!r}: unknown option {option!r} (only 'sparse')")
        if size < MINIMUM or size % ALIGNMENT:
            raise ValueError(f"--managed-pool {text!r}: SIZE must be a whole number of MiB, at least "
                             f"{MINIMUM >> 20}Mi (the smallest {kind} filesystem)")
        return cls(kind, size, option == "sparse")

    def __str__(self) -> str:
        return f"{self.kind}:{self.size >> 20}Mi" + (",sparse" if self.sparse else "")
