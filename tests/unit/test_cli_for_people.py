"""`csi-qsd volume …` and `csi-qsd qsd-stop` for people: output flags, usage errors, one-line errors."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from csi_qsd import cli
from csi_qsd.errors import FailedPrecondition, NotFound

RECORD_ACTIONS = {
    "list": [], "snapshots": [], "info": [], "create": ["v"], "snapshot": ["s", "vol-x"],
    "stats": ["vol-x", "/p"], "expand": ["vol-x", "/p", "--size", "1Gi"],
}


@pytest.mark.parametrize("action", sorted(RECORD_ACTIONS))
def test_commands_that_print_records_print_a_table_unless_asked_for_json(action: str) -> None:
    parse = cli.build_parser().parse_args
    assert parse(["volume", action, *RECORD_ACTIONS[action]]).output_format == "table"
    assert parse(["volume", action, *RECORD_ACTIONS[action], "-o", "json"]).output_format == "json"
    assert parse(["volume", action, *RECORD_ACTIONS[action], "--output", "json"]).output_format == "json"


def test_backup_and_restore_keep_their_output_file_flag() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["volume", "backup", "snap-x", "-o", "full.qcow2"]).output == "full.qcow2"
    assert parse(["volume", "restore", "full.qcow2", "-o", "out.raw"]).output == "out.raw"


@pytest.mark.parametrize("argv, flag", [
    (["volume", "create", "v", "--size", "abc"], "--size"),
    (["volume", "expand", "vol-x", "/p", "--size", "1Zi"], "--size"),
    (["volume", "create", "v", "--param", "colour"], "--param"),
    (["volume", "list", "-o", "yaml"], "-o"),
])
def test_a_bad_value_is_a_usage_error_not_a_traceback(argv: list[str], flag: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_sizes_and_parameters_are_parsed() -> None:
    args = cli.build_parser().parse_args(["volume", "create", "v", "--size", "96Mi", "--param", "a=b=c",
                                          "--param", "pool=fast"])
    assert args.size == 96 << 20 and dict(args.param) == {"a": "b=c", "pool": "fast"}
    assert cli.build_parser().parse_args(["volume", "create", "v"]).size == 1 << 30


def test_qsd_stop_takes_a_state_dir_and_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CSI_QSD_STATE_DIR", raising=False)
    args = cli.build_parser().parse_args(["qsd-stop", "--state-dir", "/x/state"])
    assert (args.state_dir, args.force) == ("/x/state", False)
    assert cli.build_parser().parse_args(["qsd-stop", "--force"]).force is True


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_an_error_is_one_line_with_its_csi_code(tmp_path: Path) -> None:
    error = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "volume vol-x is still staged\non node-a")
    assert cli.error_line(error) == "FAILED_PRECONDITION: volume vol-x is still staged on node-a"
    assert cli.error_line(NotFound("snapshot snap-x is not in the catalog")) == (
        "NOT_FOUND: snapshot snap-x is not in the catalog")
    local = OSError(13, "Permission denied", "/out.qcow2")  # no CSI code: its own words
    assert cli.error_line(local) == "[Errno 13] Permission denied: '/out.qcow2'"


def test_an_unreachable_driver_is_named(tmp_path: Path) -> None:
    endpoint = f"unix://{tmp_path / 'csi.sock'}"
    unreachable = rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: ...")
    assert cli.error_line(unreachable, endpoint) == (
        f"UNAVAILABLE: nothing serves {endpoint}: no such socket (is `csi-qsd serve` running?)")
    (tmp_path / "csi.sock").touch()  # a socket is there: gRPC's own words say why it failed
    assert cli.error_line(unreachable, endpoint) == "UNAVAILABLE: failed to connect to all addresses; last error: ..."


def test_a_command_that_fails_prints_one_line_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    def refused() -> int:
        raise FailedPrecondition("the catalog records 1 staged volume(s)")

    assert cli.for_a_person(refused) == 1
    captured = capsys.readouterr()
    assert captured.err == "error: FAILED_PRECONDITION: the catalog records 1 staged volume(s)\n"
    assert captured.out == ""
