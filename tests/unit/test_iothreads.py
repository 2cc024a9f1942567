"""The pool of iothreads: its size bounds, QSD's arguments, and where exports go."""

from __future__ import annotations

import pytest

from csi_qsd.qsd import iothreads
from csi_qsd.qsd.iothreads import IOThreadPool


def test_pool_size_is_one_to_four_per_core() -> None:
    assert iothreads.check_size(1, 2) == 1
    assert iothreads.check_size(8, 2) == 8
    for bad in (0, -1, 9):
        with pytest.raises(ValueError, match=r"1\.\.8"):
            iothreads.check_size(bad, 2)


def test_the_first_thread_is_the_one_older_drivers_made() -> None:
    assert iothreads.pool_ids(3) == ["iothread0", "iothread1", "iothread2"]
    assert iothreads.command_line(2, None) == ["--object", "iothread,id=iothread0", "--object", "iothread,id=iothread1"]
    assert iothreads.command_line(1, 0) == ["--object", "iothread,id=iothread0,poll-max-ns=0"]
    assert iothreads.object_args("iothread1", 5000) == {"qom-type": "iothread", "id": "iothread1", "poll-max-ns": 5000}
    assert "poll-max-ns" not in iothreads.object_args("iothread1", None)


def test_exports_go_to_the_least_loaded_thread_and_stay_there() -> None:
    pool = IOThreadPool(2)
    assert pool.place("a", []) == "iothread0"
    assert pool.place("b", ["a"]) == "iothread1"
    assert pool.place("c", ["a", "b"]) == "iothread0"
    assert pool.place("a", ["a", "b", "c"]) == "iothread0"  # placed again (a re-add): where it was
    assert pool.load() == {"iothread0": 2, "iothread1": 1}


def test_without_spreading_every_export_goes_to_the_first_thread() -> None:
    pool = IOThreadPool(4, spread=False)
    assert [pool.place(name, ["a", "b"]) for name in ("a", "b", "c")] == ["iothread0"] * 3


def test_exports_gone_from_qsd_free_their_thread() -> None:
    pool = IOThreadPool(2)
    for name, live in (("a", []), ("b", ["a"]), ("c", ["a", "b"])):
        pool.place(name, live)
    # a and c (iothread0) were removed: the next export goes there, b stays where it is.
    assert pool.place("d", ["b"]) == "iothread0"
    assert pool.load() == {"iothread0": 1, "iothread1": 1}
