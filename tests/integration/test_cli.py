"""The README's walk-through: `csi-qsd volume …` against `csi-qsd serve` in another process.

Tables for people, `-o json` for scripts, errors on one line with their CSI
code, and `csi-qsd qsd-stop` for the QSD that outlives the driver.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys

from testing.harness import DriverProcess, Sandbox, qsd_pid, until
from testing.helpers.cli_process import csi_qsd, start_qsd_container


async def cli(box: Sandbox, *args: str, expect: int = 0) -> str:
    code, out, err = await csi_qsd("volume", "--endpoint", box.endpoint, *args)
    assert code == expect, f"csi-qsd volume {' '.join(args)}: {err}"
    if expect:
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return out if expect == 0 else err


def one_row(table: str, first_cell: str) -> list[str]:
    """The cells of the table row that starts with `first_cell` (cells are 3 spaces apart)."""
    rows = [line for line in table.splitlines() if line.startswith(first_cell + " ")]
    assert len(rows) == 1, table
    return [cell.strip() for cell in rows[0].split("   ") if cell.strip()]


async def test_volume_lifecycle_through_the_cli(box: Sandbox) -> None:
    driver = DriverProcess(box)
    await driver.start()
    try:
        info = json.loads(await cli(box, "info", "-o", "json"))
        assert info["name"] == "csi-qsd.io" and info["ready"] is True and info["available_bytes"] > 0
        table = (await cli(box, "info")).splitlines()
        assert table[0].split() == ["DRIVER", "VERSION", "READY", "AVAILABLE"]
        assert table[1].split()[:3] == ["csi-qsd.io", info["version"], "yes"]
        assert table[1].split()[-1] in ("MiB", "GiB", "TiB"), table

        assert (await cli(box, "list")) == "" and (await cli(box, "list", "-o", "json")) == ""
        created = json.loads(await cli(box, "create", "cli-volume", "--size", "96Mi", "-o", "json"))
        vid = created["volume_id"]
        assert int(created["capacity_bytes"]) == 96 << 20
        listed = [json.loads(line) for line in (await cli(box, "list", "-o", "json")).splitlines()]
        assert [v["volume_id"] for v in listed] == [vid]
        assert listed[0]["capacity_bytes"] == str(96 << 20) and listed[0]["volume_context"]["export"] == "filesystem"
        table = await cli(box, "list")
        assert [name.strip() for name in table.splitlines()[0].split("   ") if name] == [
            "VOLUME ID", "SIZE", "EXPORT", "FORMAT", "SOURCE", "PUBLISHED ON", "CONDITION"]
        assert one_row(table, vid) == [vid, "96.0 MiB", "filesystem", "qcow2", "-", "-", "ok"]

        staging, target = box.staging("cli"), box.target("cli-pod")
        await cli(box, "stage", vid, str(staging))
        await cli(box, "publish", vid, str(staging), str(target))
        (target / "hello.txt").write_text("hello")
        stats = json.loads(await cli(box, "stats", vid, str(target), "-o", "json"))
        assert {u["unit"] for u in stats["usage"]} == {"BYTES", "INODES"}
        assert one_row(await cli(box, "list"), vid)[-2:] == ["node-a", "ok"]

        error = await cli(box, "delete", vid, expect=1)
        assert "FAILED_PRECONDITION" in error and vid in error

        snapshot = json.loads(await cli(box, "snapshot", "cli-snap", vid, "-o", "json"))
        sid = snapshot["snapshot_id"]
        assert snapshot["source_volume_id"] == vid and snapshot["ready_to_use"] is True
        listed_snaps = [json.loads(line) for line in (await cli(box, "snapshots", "-o", "json")).splitlines()]
        assert [s["snapshot_id"] for s in listed_snaps] == [sid]
        row = one_row(await cli(box, "snapshots"), sid)
        assert row[:3] == [sid, vid, "96.0 MiB"] and row[-2:] == ["yes", "-"]
        restored = await cli(box, "create", "cli-restore", "--size", "96Mi", "--from-snapshot", sid)
        restored_id = restored.splitlines()[1].split()[0]
        assert one_row(restored, restored_id) == [restored_id, "96.0 MiB", "filesystem", "qcow2", sid]
        await cli(box, "delete", restored_id)
        await cli(box, "delete-snapshot", sid)
        assert (await cli(box, "snapshots", "-o", "json")) == ""

        await cli(box, "unpublish", vid, str(target))
        grown = json.loads(await cli(box, "expand", vid, str(staging), "--size", "128Mi", "-o", "json"))
        assert grown["capacity_bytes"] == 128 << 20
        await cli(box, "publish", vid, str(staging), str(target))
        assert (target / "hello.txt").read_text() == "hello"

        await cli(box, "unpublish", vid, str(target))
        await cli(box, "unstage", vid, str(staging))
        await cli(box, "delete", vid)
        assert (await cli(box, "list", "-o", "json")) == ""

        error = await cli(box, "create", "bad", "--param", "colour=blue", expect=1)
        assert error.startswith("error: INVALID_ARGUMENT: ") and "colour" in error
        error = await cli(box, "stats", "vol-" + "0" * 24, str(staging), expect=1)
        assert error.startswith("error: NOT_FOUND: ") and "vol-" + "0" * 24 in error
    finally:
        await driver.stop()


async def test_an_unreachable_driver_is_one_line_naming_the_endpoint(box: Sandbox) -> None:
    endpoint = f"unix://{box.root / 'nothing.sock'}"
    for args in (["list"], ["list", "-o", "json"], ["delete", "vol-" + "0" * 24]):
        code, out, err = await csi_qsd("volume", "--endpoint", endpoint, *args)
        assert (code, out) == (1, "")
        assert err == f"error: UNAVAILABLE: nothing serves {endpoint}: no such socket (is `csi-qsd serve` running?)\n"


def gone(pid: int) -> bool:
    """The process has exited (a zombie left for a parent to reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_stopping_the_driver_says_qsd_runs_on_and_qsd_stop_stops_it(box: Sandbox) -> None:
    state = str(box.state_dir.resolve())
    stop = ("qsd-stop", "--state-dir", str(box.state_dir))
    driver = DriverProcess(box)
    await driver.start()
    try:
        vid = json.loads(await cli(box, "create", "stop-volume", "--size", "64Mi", "-o", "json"))["volume_id"]
        staging = box.staging("stop")
        await cli(box, "stage", vid, str(staging))
        pid = qsd_pid(box)
        assert pid is not None

        code, _, err = await csi_qsd(*stop)  # the driver would start a new QSD at once
        assert code == 1 and err == (f"error: FAILED_PRECONDITION: a driver still serves unix://{state}/csi.sock: "
                                     "stop `csi-qsd serve` first, or it starts qemu-storage-daemon again\n")
        assert driver.proc is not None
        driver.proc.send_signal(signal.SIGINT)  # Ctrl-C on scripts/run.sh
        assert await driver.wait_exit() == 0
        assert f"qemu-storage-daemon (pid {pid}) keeps running by design" in driver.log()
        assert f"To stop it: csi-qsd qsd-stop --state-dir {state}\n" in driver.log()

        code, out, err = await csi_qsd(*stop)  # a staged volume: its pod would lose its disk
        assert (code, out) == (1, "") and err.count("\n") == 1
        assert err.startswith("error: FAILED_PRECONDITION: the catalog records 1 staged volume(s)")
        assert vid in err and "--force" in err
        assert qsd_pid(box) == pid and not gone(pid)

        await driver.start()  # adopts the same QSD
        assert qsd_pid(box) == pid
        await cli(box, "unstage", vid, str(staging))
        await driver.stop()  # SIGTERM: the same words
        assert driver.log().count("keeps running by design") == 2

        code, out, err = await csi_qsd(*stop)
        assert (code, out, err) == (0, f"stopped qemu-storage-daemon (pid {pid}) of {state}\n", "")
        await until(lambda: gone(pid), f"QSD pid {pid} to exit", 15)
        assert qsd_pid(box) is None
        assert await csi_qsd(*stop) == (0, f"no qemu-storage-daemon runs for {state}\n", "")
    finally:
        await driver.stop()


async def test_serve_refuses_a_bad_configuration_with_a_clear_message(box: Sandbox) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for extra, expected in (
            (["--metrics-address", f"127.0.0.1:{port}"], f"cannot serve metrics on '127.0.0.1:{port}'"),
            (["--endpoint", "tcp://0.0.0.0:1"], "must start with unix://"),
        ):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "csi_qsd.cli", "serve", "--state-dir", str(box.state_dir),
                "--target-root", str(box.kubelet), *extra,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 1
            assert expected in err.decode() and "Traceback" not in err.decode()


async def test_stopping_the_driver_in_external_mode_leaves_qsd_to_its_container(box: Sandbox) -> None:
    """There QSD is the qsd container's (`csi-qsd qsd-run`): the driver says nothing of stopping it."""
    qsd = await start_qsd_container(box)
    driver = DriverProcess(box, "--qsd-mode", "external")
    try:
        await driver.start()
        assert qsd_pid(box) == qsd.pid
        assert driver.proc is not None
        driver.proc.send_signal(signal.SIGINT)
        assert await driver.wait_exit() == 0
        log = driver.log()
        assert "listening on" in log and "event=qsd_state from=running to=stopped" in log
        assert "keeps running" not in log and "qsd-stop" not in log
    finally:
        await driver.stop()
        if qsd.returncode is None:
            qsd.send_signal(signal.SIGTERM)
            await qsd.wait()
