"""The README's walk-through: `csi-qsd volume …` against `csi-qsd serve` in another process."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

from tests.harness import DriverProcess, Sandbox


async def cli(box: Sandbox, *args: str, expect: int = 0) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "csi_qsd.cli", "volume", "--endpoint", box.endpoint, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == expect, f"csi-qsd volume {' '.join(args)}: {err.decode()}"
    return out.decode() if expect == 0 else err.decode()


async def test_volume_lifecycle_through_the_cli(box: Sandbox) -> None:
    driver = DriverProcess(box)
    await driver.start()
    try:
        info = json.loads(await cli(box, "info"))
        assert info["name"] == "csi-qsd.io" and info["ready"] is True and info["available_bytes"] > 0

        created = json.loads(await cli(box, "create", "cli-volume", "--size", "96Mi"))
        vid = created["volume_id"]
        assert int(created["capacity_bytes"]) == 96 << 20
        listed = [json.loads(line) for line in (await cli(box, "list")).splitlines()]
        assert [v["volume_id"] for v in listed] == [vid]

        staging, target = box.staging("cli"), box.target("cli-pod")
        await cli(box, "stage", vid, str(staging))
        await cli(box, "publish", vid, str(staging), str(target))
        (target / "hello.txt").write_text("hello")
        stats = json.loads(await cli(box, "stats", vid, str(target)))
        assert {u["unit"] for u in stats["usage"]} == {"BYTES", "INODES"}

        error = await cli(box, "delete", vid, expect=1)
        assert "FAILED_PRECONDITION" in error and vid in error

        snapshot = json.loads(await cli(box, "snapshot", "cli-snap", vid))
        assert snapshot["source_volume_id"] == vid and snapshot["ready_to_use"] is True
        listed_snaps = [json.loads(line) for line in (await cli(box, "snapshots")).splitlines()]
        assert [s["snapshot_id"] for s in listed_snaps] == [snapshot["snapshot_id"]]
        restored = json.loads(await cli(box, "create", "cli-restore", "--size", "96Mi",
                                        "--from-snapshot", snapshot["snapshot_id"]))
        assert restored["content_source"]["snapshot"]["snapshot_id"] == snapshot["snapshot_id"]
        await cli(box, "delete", restored["volume_id"])
        await cli(box, "delete-snapshot", snapshot["snapshot_id"])
        assert (await cli(box, "snapshots")).strip() == ""

        await cli(box, "unpublish", vid, str(target))
        grown = json.loads(await cli(box, "expand", vid, str(staging), "--size", "128Mi"))
        assert grown["capacity_bytes"] == 128 << 20
        await cli(box, "publish", vid, str(staging), str(target))
        assert (target / "hello.txt").read_text() == "hello"

        await cli(box, "unpublish", vid, str(target))
        await cli(box, "unstage", vid, str(staging))
        await cli(box, "delete", vid)
        assert (await cli(box, "list")).strip() == ""

        error = await cli(box, "create", "bad", "--param", "colour=blue", expect=1)
        assert "INVALID_ARGUMENT" in error and "colour" in error
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
