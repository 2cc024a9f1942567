"""The client's record of QSD's graph: kept only from listings and confirmed commands, dropped on any doubt."""

from __future__ import annotations

from csi_qsd.qsd.view import BlockExportInfo, GraphView


def listed() -> GraphView:
    view = GraphView()
    view.nodes = {"a-f", "a-q"}
    view.exports = {"a-e": BlockExportInfo(id="a-e", type="fuse", node_name="a-q", shutting_down=False)}
    view.objects = {"a-tg": "child<throttle-group>"}
    return view


def test_confirmed_adds_and_removes_follow_the_commands() -> None:
    view = listed()
    view.confirmed("blockdev-add", {"driver": "raw", "node-name": "b-f",
                                    "file": {"driver": "host_device", "node-name": "b-dev", "filename": "/dev/x"}},
                   set())
    view.confirmed("blockdev-del", {"node-name": "a-f"}, set())
    view.confirmed("object-add", {"qom-type": "iothread", "id": "b-io"}, set())
    view.confirmed("object-del", {"id": "a-tg"}, set())
    view.confirmed("block-export-add", {"type": "vhost-user-blk", "id": "b-e", "node-name": "b-f"}, set())
    assert view.nodes == {"a-q", "b-f", "b-dev"}
    assert view.objects == {"b-io": "child<iothread>"}
    assert view.exports is not None and set(view.exports) == {"a-e", "b-e"}
    assert view.exports["b-e"]["node_name"] == "b-f"


def test_an_inline_child_without_a_name_adds_nothing_for_it() -> None:
    view = listed()
    view.confirmed("blockdev-add", {"driver": "raw", "node-name": "b-f", "file": {"driver": "host_device"}}, set())
    assert view.nodes == {"a-f", "a-q", "b-f"}


def test_an_export_being_deleted_stays_until_qsd_says_it_is_gone() -> None:
    view = listed()
    view.confirmed("block-export-del", {"id": "a-e", "mode": "hard"}, set())
    assert view.exports is not None and view.exports["a-e"]["shutting_down"]
    view.event("BLOCK_EXPORT_DELETED", {"id": "a-e"})
    assert view.exports == {}
    assert view.nodes == {"a-f", "a-q"}


def test_unknown_or_graph_changing_commands_drop_the_record() -> None:
    for command in ("transaction", "block-stream", "job-dismiss", "blockdev-mirror", "quit", "x-new-command"):
        view = listed()
        view.confirmed(command, {}, set())
        assert view.nodes is None and view.exports is None and view.objects is None, command


def test_neutral_commands_keep_the_record_and_its_epoch() -> None:
    view = listed()
    epoch = view.epoch
    for command in ("query-block-exports", "qom-set", "block_resize", "blockdev-reopen", "query-version"):
        view.confirmed(command, {}, set())
        view.failed(command)
    assert view.nodes == {"a-f", "a-q"} and view.epoch == epoch


def test_a_failed_change_drops_the_record() -> None:
    view = listed()
    view.failed("blockdev-add")
    assert view.nodes is None and view.exports is None and view.objects is None


def test_every_change_moves_the_epoch_so_an_overtaken_listing_is_not_kept() -> None:
    view = GraphView()
    for command, args in (("blockdev-add", {"node-name": "x"}), ("object-add", {"qom-type": "iothread", "id": "i"}),
                          ("block-export-add", {"id": "e", "type": "fuse", "node-name": "x"})):
        epoch = view.epoch
        view.confirmed(command, args, set())
        assert view.epoch > epoch, command
    epoch = view.epoch
    view.event("BLOCK_EXPORT_DELETED", {"id": "e"})
    assert view.epoch > epoch


def test_ended_jobs_drop_the_record_and_running_ones_do_not() -> None:
    view = listed()
    view.event("JOB_STATUS_CHANGE", {"id": "j", "status": "running"})
    assert view.nodes is not None
    view.event("JOB_STATUS_CHANGE", {"id": "j", "status": "concluded"})
    assert view.nodes is None
    view = listed()
    view.event("BLOCK_JOB_COMPLETED", {"device": "j"})
    assert view.nodes is None


def test_an_export_readded_while_its_deletion_was_reported_is_listed_again() -> None:
    view = listed()
    view.confirmed("block-export-add", {"id": "a-e", "type": "fuse", "node-name": "a-q"}, {"a-e"})
    assert view.exports is None
    assert view.nodes == {"a-f", "a-q"}
