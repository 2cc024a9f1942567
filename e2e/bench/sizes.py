"""Sizes in bytes, as the benchmarks size their volumes and I/O.
"""

from __future__ import annotations

KIB = 1 << 10

MIB = 1 << 20

GIB = 1 << 30
