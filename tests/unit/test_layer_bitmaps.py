"""Layer bitmaps: which records a merge carries, under which names, and which a delta reads."""

from __future__ import annotations

from csi_qsd.qcow2.layer_bitmaps import OWN, Bitmap, carried_name, needed_for, parse_carried, plan_carry

G = 65536


def own(consistent: bool = True) -> dict[str, Bitmap]:
    return {OWN: Bitmap(OWN, G, consistent)}


def test_names_round_trip() -> None:
    for depth, image, lost in ((0, "vol-a.1.qcow2", False), (12, "vol-a-lost.qcow2", True), (3, "x-lost", False)):
        parsed = parse_carried(carried_name(depth, image, lost))
        assert parsed is not None and (parsed.depth, parsed.image, parsed.lost) == (depth, image, lost)
    assert parse_carried(OWN) is None and parse_carried("backup-1") is None


def test_each_layer_below_is_carried_newest_first() -> None:
    steps = plan_carry([("s2.qcow2", own()), ("s1.qcow2", own()), ("s0.qcow2", own())], {OWN})
    assert [(s.target, s.layer, s.source) for s in steps] == [
        ("cbt-000-s2.qcow2", 0, OWN), ("cbt-001-s1.qcow2", 1, OWN), ("cbt-002-s0.qcow2", 2, OWN)]


def test_a_layer_merged_before_brings_its_records_renumbered_below_it() -> None:
    earlier = own() | {carried_name(0, "s1.qcow2", False): Bitmap(carried_name(0, "s1.qcow2", False), G, True),
                       carried_name(1, "s0.qcow2", True): Bitmap(carried_name(1, "s0.qcow2", True), G, True)}
    steps = plan_carry([("s3.qcow2", own()), ("s2.qcow2", earlier)], {OWN})
    assert [(s.target, s.layer, s.source) for s in steps] == [
        ("cbt-000-s3.qcow2", 0, OWN),
        ("cbt-001-s2.qcow2", 1, OWN),
        ("cbt-002-s1.qcow2", 1, "cbt-000-s1.qcow2"),
        ("cbtlost-003-s0.qcow2", 1, None),
    ]


def test_an_inconsistent_or_missing_record_is_carried_as_lost() -> None:
    steps = plan_carry([("s1.qcow2", own(consistent=False)), ("raw.img", {})], set())
    assert [(s.target, s.source) for s in steps] == [("cbtlost-000-s1.qcow2", None), ("cbtlost-001-raw.img", None)]


def test_a_retried_merge_skips_what_is_already_carried() -> None:
    steps = plan_carry([("s1.qcow2", own()), ("s0.qcow2", own())], {OWN, "cbt-000-s1.qcow2"})
    assert [s.target for s in steps] == ["cbt-001-s0.qcow2"]


def merged(*carried: tuple[int, str, bool], consistent_own: bool = True) -> dict[str, Bitmap]:
    found = own(consistent_own)
    for depth, image, lost in carried:
        name = carried_name(depth, image, lost)
        found[name] = Bitmap(name, G, True)
    return found


def test_a_delta_reads_the_own_record_and_every_carried_layer_newer_than_the_base() -> None:
    bitmaps = merged((0, "s2.qcow2", False), (1, "s1.qcow2", False), (2, "s0.qcow2", False))
    needed = needed_for("s0.qcow2", bitmaps)
    assert needed is not None and not needed.lost
    assert needed.names == [OWN, "cbt-000-s2.qcow2", "cbt-001-s1.qcow2"]
    first = needed_for("s2.qcow2", bitmaps)
    assert first is not None and first.names == [OWN]


def test_a_base_that_was_not_merged_in_is_not_answered_here() -> None:
    assert needed_for("other.qcow2", merged((0, "s2.qcow2", False))) is None


def test_a_lost_record_between_base_and_target_forces_the_fallback() -> None:
    needed = needed_for("s0.qcow2", merged((0, "s2.qcow2", False), (1, "s1.qcow2", True), (2, "s0.qcow2", False)))
    assert needed is not None and needed.lost and not needed.names
    older_lost = needed_for("s1.qcow2", merged((0, "s2.qcow2", False), (1, "s1.qcow2", True)))
    assert older_lost is not None and not older_lost.lost, "the base's own record is never needed"


def test_an_inconsistent_own_record_forces_the_fallback() -> None:
    needed = needed_for("s1.qcow2", merged((0, "s1.qcow2", False), consistent_own=False))
    assert needed is not None and "inconsistent" in needed.lost
