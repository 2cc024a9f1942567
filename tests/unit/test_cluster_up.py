"""scripts/cluster.sh (testing/cluster/up.py): what it prints of the examples, and how it finds what a cluster left.

The whole up and down runs against a real cluster by hand (README.md, "Try it"); the cluster tier runs
the same start and teardown steps (testing/cluster/session.py) every session.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from testing.cluster import examples, up
from testing.cluster.build import QEMU_IMAGE


def test_vm_example_runs_the_local_qemu_on_tcg_and_keeps_the_rest() -> None:
    shipped = examples.example("qemu-vhost-user-blk.yaml")
    local = up.local_example("qemu-vhost-user-blk.yaml")
    assert examples.pick(local, "PersistentVolumeClaim") == examples.pick(shipped, "PersistentVolumeClaim")
    pod, before = examples.pick(local, "Pod"), examples.pick(shipped, "Pod")
    [container], [original] = pod["spec"]["containers"], before["spec"]["containers"]
    assert container["image"] == QEMU_IMAGE and container["imagePullPolicy"] == "Never"
    [script] = container["args"]
    assert script.startswith("exec qemu-system-x86_64 ") and "apt-get" not in script
    assert "accel=tcg" in script and "kvm" not in script and "-cpu max" in script
    for kept in ("path=/vm-disk/vhost-user-blk.sock,reconnect=1", "memory-backend-memfd,id=mem,size=1G,share=on",
                 "vhost-user-blk-pci,chardev=disk0"):
        assert kept in script and kept in original["args"][0]
    assert "devices.kubevirt.io/kvm" not in container["resources"]["limits"]
    assert container["resources"]["requests"] == original["resources"]["requests"]
    assert pod["spec"]["volumes"] == before["spec"]["volumes"]
    assert pod["spec"]["securityContext"] == before["spec"]["securityContext"]


def test_other_examples_are_printed_as_shipped() -> None:
    assert up.local_example("filesystem-pod.yaml") == examples.example("filesystem-pod.yaml")


def test_a_process_naming_the_state_dir_is_found_until_it_is_gone(tmp_path: Path) -> None:
    base = tmp_path / "try"
    # One process that forks nothing (a shell's children carry its command line until they exec).
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"{base}/node"])
    try:
        # Popen can return before the child's exec has set its command line.
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{process.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.pid in up.processes_naming(base)
    finally:
        process.kill()
        process.wait()
    assert up.processes_naming(base) == []


def test_a_pidfile_of_another_program_is_no_keeper(tmp_path: Path) -> None:
    files = up._Files(tmp_path)
    assert files.keeper_pid() == 0
    process = subprocess.Popen(["sleep", "60"])
    try:
        files.pid.write_text(str(process.pid))
        assert files.keeper_pid() == 0
    finally:
        process.kill()
        process.wait()
