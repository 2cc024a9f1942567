"""qsd/ keeps QMP and our naming scheme to itself: name decoding, typed blockstats, error classes, the
watchdog's arithmetic and diagnostics, and the fixed locale of host tools."""

from __future__ import annotations

import os
import threading

import pytest

from csi_qsd import validate
from csi_qsd.cli import build_parser, config_from
from csi_qsd.errors import Code, NoAnswer, QSDError, QSDNoAnswer, QSDUnavailable
from csi_qsd.qsd import graph, stats
from csi_qsd.qsd.client import BlockExportInfo, parse_blockstats
from csi_qsd.qsd.daemon import PING_MAX, ping_interval, process_state, thread_diagnostics
from csi_qsd.sys.run import tool_env

VID = validate.new_volume_id()


@pytest.mark.parametrize("generation", [0, 1, 35, 36, graph.MAX_GENERATION])
def test_parse_name_round_trips_every_name_we_write(generation: int) -> None:
    nodes = graph.nodes_for(VID, generation)
    assert graph.parse_name(nodes.file) == graph.ParsedName(VID, graph.NameKind.FILE, generation)
    assert graph.parse_name(nodes.format) == graph.ParsedName(VID, graph.NameKind.FORMAT, generation)
    assert graph.parse_name(nodes.fuse_export) == graph.ParsedName(VID, graph.NameKind.FUSE_EXPORT)
    assert graph.parse_name(nodes.vhost_export) == graph.ParsedName(VID, graph.NameKind.VHOST_EXPORT)
    assert graph.parse_name(graph.own_iothread_id(nodes)) == graph.ParsedName(VID, graph.NameKind.IOTHREAD)
    assert graph.format_node_over(nodes.file) == nodes.format
    assert graph.format_node_over(nodes.format) is None


@pytest.mark.parametrize("name", [
    "", "iothread0", "#block123", "cq", "cqxyz-q0", f"cq{VID[4:]}-q", f"cq{VID[4:]}-x0", f"cq{VID[4:]}-qZ",
    f"cq{VID[4:]}-q!", f"cq{VID[4:]}-fusex", f"cq{VID[4:]}-q2bin",
])
def test_parse_name_refuses_names_that_are_not_ours(name: str) -> None:
    assert graph.parse_name(name) is None


def test_format_generations_newest_first_and_only_that_volumes() -> None:
    other = validate.new_volume_id()
    names = [graph.nodes_for(VID, g).format for g in (0, 2, 1)] + [graph.nodes_for(VID, 5).file,
             graph.nodes_for(other, 9).format, graph.nodes_for(VID).fuse_export, "#block1"]
    assert graph.format_generations(names, VID) == [2, 1, 0]
    assert graph.format_generations(names, other) == [9]


def test_blockstats_are_typed_and_skip_anonymous_nodes() -> None:
    raw = [
        {"node-name": "cqa-q0", "stats": {"wr_highest_offset": 4096, "wr_bytes": 8, "unmap_bytes": 1}},
        {"stats": {"wr_highest_offset": 1}},  # an anonymous export backend
        {"node-name": "cqa-f0", "stats": {}},
        {"node-name": "", "stats": {"wr_highest_offset": 1}},
    ]
    parsed = parse_blockstats(raw)  # type: ignore[arg-type]
    assert set(parsed) == {"cqa-q0", "cqa-f0"}
    assert parsed["cqa-q0"]["wr_highest_offset"] == 4096 and parsed["cqa-q0"]["wr_bytes"] == 8
    assert parsed["cqa-f0"]["wr_highest_offset"] == 0


def test_top_node_stats_maps_our_exports_to_their_volumes() -> None:
    nodes = graph.nodes_for(VID, 3)
    exports = {
        nodes.fuse_export: BlockExportInfo(id=nodes.fuse_export, type="fuse", node_name=nodes.format,
                                           shutting_down=False),
        "someone-else": BlockExportInfo(id="someone-else", type="nbd", node_name="x", shutting_down=False),
    }
    figures = parse_blockstats([{"node-name": nodes.format, "stats": {"wr_highest_offset": 7}},
                                {"node-name": "x", "stats": {"wr_highest_offset": 9}}])
    assert {vid: s["wr_highest_offset"] for vid, s in stats.top_node_stats(exports, figures).items()} == {VID: 7}


def test_qsd_errors_carry_qemus_class_and_no_answer_is_retryable() -> None:
    refused = QSDError("qemu-storage-daemon refused blockdev-del: nope", error_class="GenericError")
    assert refused.error_class == "GenericError" and refused.code is Code.INTERNAL
    assert QSDUnavailable("went away").error_class is None
    silent = QSDNoAnswer("no answer", NoAnswer("query-version", 10.0, 1, ()))
    assert isinstance(silent, QSDUnavailable) and silent.code is Code.UNAVAILABLE
    assert silent.report.command == "query-version"


@pytest.mark.parametrize(("timeout", "expected"), [(0.1, 0.2), (1.0, 0.5), (10.0, 5.0), (300.0, PING_MAX)])
def test_ping_interval(timeout: float, expected: float) -> None:
    assert ping_interval(timeout) == expected


def test_diagnostics_read_state_threads_and_wait_channels() -> None:
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="diag-helper")
    helper.start()
    try:
        assert process_state(os.getpid()).startswith(("R", "S"))
        threads = thread_diagnostics(os.getpid())
        assert {t.tid for t in threads} >= {os.getpid(), helper.native_id}
        assert all(t.name for t in threads)
        mine = next(t for t in threads if t.tid == helper.native_id)
        assert mine.wchan  # blocked on the event: a futex wait
    finally:
        stop.set()
        helper.join()
    assert process_state(2**22 + 1) == "" and thread_diagnostics(2**22 + 1) == []


def test_host_tools_run_in_the_c_locale_with_the_callers_path() -> None:
    env = tool_env({"PATH": "/x/bin:/usr/bin", "LANG": "de_DE.UTF-8", "LC_ALL": "fr_FR.UTF-8", "LANGUAGE": "de"})
    assert env == {"PATH": "/x/bin:/usr/bin", "LANG": "de_DE.UTF-8", "LC_ALL": "C"}
    assert tool_env()["PATH"] == os.environ["PATH"]


def test_qmp_timeout_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["serve", "--state-dir", "/tmp/s", "--qmp-timeout", "2.5"])
    assert config_from(args).qmp_timeout == 2.5
    monkeypatch.setenv("CSI_QSD_QMP_TIMEOUT", "0.75")
    assert config_from(build_parser().parse_args(["serve", "--state-dir", "/tmp/s"])).qmp_timeout == 0.75
    assert config_from(build_parser().parse_args(["serve", "--state-dir", "/tmp/s"])).qmp_timeout > 0
    monkeypatch.delenv("CSI_QSD_QMP_TIMEOUT")
    assert config_from(build_parser().parse_args(["serve", "--state-dir", "/tmp/s"])).qmp_timeout == 10.0
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--state-dir", "/tmp/s", "--qmp-timeout", bad])
