"""The CSI community's conformance suite (csi-sanity) against `csi-qsd serve`: every spec passes.

csi-sanity plays the CO: it creates, stages, publishes, expands, snapshots
and deletes volumes the way Kubernetes' sidecars and kubelet do, with the
requests they really send (empty maps, unknown IDs with odd paths). One pass
with filesystem volumes, one with block volumes, each against a fresh driver.

One spec may be skipped, and only where the host withholds the capability it
needs: "should work if node-expand is called after node-publish" grows ext4
while it is mounted, which the kernel allows only with CAP_SYS_RESOURCE; a
driver without it answers FAILED_PRECONDITION naming the capability (tested
in test_expansion), which csi-sanity counts as a failure. It is still
counted toward the specs the pass must run.

After each pass the host and QSD must hold nothing of the driver's: no
mount or loop device under the sandbox, no export and no block node in QSD
(asked once the driver has stopped: QSD's monitor takes one client).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import pytest

from csi_qsd.sys import caps
from testing.harness import Sandbox, running_driver
from testing.leftovers import host_leftovers, qsd_leftovers

REPO = Path(__file__).resolve().parents[2]
SANITY_MODULE, SANITY_VERSION = "github.com/kubernetes-csi/csi-test/v5", "v5.6.0"
# Where no Go toolchain or module proxy can be reached: a prebuilt v5.5.0 beside the project.
FALLBACK = REPO.parent / "shared" / "bin" / "csi-sanity"
MIB = 1 << 20
MIN_SPECS = 82  # what csi-sanity v5.5 and v5.6 run against a driver with this one's capabilities


def _sanity() -> Path:
    """csi-sanity: $CSI_SANITY, else built from its module (cached by version), else the fallback."""
    if os.environ.get("CSI_SANITY"):
        return Path(os.environ["CSI_SANITY"])
    cache = Path(os.environ.get("CSI_QSD_CACHE_DIR", Path.home() / ".cache" / "csi-qsd")) / "csi-sanity" / SANITY_VERSION
    built = subprocess.run(["bash", str(REPO / "scripts" / "build-go-module.sh"), SANITY_MODULE, SANITY_VERSION,
                            str(cache), "cmd/csi-sanity"], capture_output=True, text=True)
    if built.returncode == 0 and (cache / "csi-sanity").is_file():
        return cache / "csi-sanity"
    return FALLBACK


SANITY = _sanity()
ONLINE_EXT4_SPEC = "should work if node-expand is called after node-publish"
RAN = re.compile(r"Ran (\d+) of (\d+) Specs")
TALLY = re.compile(r"(\d+) Passed \| (\d+) Failed")


async def run_sanity(box: Sandbox, *extra: str) -> tuple[int, int, int, str]:
    """(specs run, passed, failed, output) of one csi-sanity pass against the driver of `box`."""
    (box.kubelet / "sanity").mkdir(exist_ok=True)  # csi-sanity makes its directories, not their parent
    proc = await asyncio.create_subprocess_exec(
        str(SANITY), "--csi.endpoint", box.endpoint,
        "--csi.mountdir", str(box.kubelet / "sanity" / "target"),
        "--csi.stagingdir", str(box.kubelet / "sanity" / "staging"),
        "--csi.testvolumesize", str(64 * MIB), "--ginkgo.no-color", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=box.root,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 600)
    text = out.decode(errors="replace")
    ran, tally = RAN.search(text), TALLY.search(text)
    assert ran and tally, f"csi-sanity (exit {proc.returncode}) printed no summary:\n{text[-4000:]}"
    return int(ran.group(1)), int(tally.group(1)), int(tally.group(2)), text


@pytest.mark.parametrize("mode", ["filesystem", "block"])
async def test_csi_sanity_passes_every_spec(box: Sandbox, mode: str) -> None:
    assert SANITY.is_file(), f"csi-sanity not found at {SANITY} (set CSI_SANITY to its path)"
    extra: list[str] = []
    skipped = 0
    if mode == "block":
        extra += ["--csi.testvolumeaccesstype", "block"]
    elif not caps.has(caps.CAP_SYS_RESOURCE):
        extra += ["--ginkgo.skip", re.escape(ONLINE_EXT4_SPEC)]
        skipped = 1
    async with running_driver(box):
        ran, passed, failed, text = await run_sanity(box, *extra)
        left = host_leftovers(box.root)
    # QSD outlives the driver by design; its monitor takes one client, free once the driver is gone.
    exports, nodes = await qsd_leftovers(box.state_dir, quit_after=True)
    print(f"csi-sanity {mode}: " + " | ".join(m.group(0) for m in (RAN.search(text), TALLY.search(text)) if m))
    failures = [line.strip() for line in text.splitlines() if "[FAIL]" in line]
    assert failed == 0, f"csi-sanity {mode}: {failed} failed:\n" + "\n".join(failures) + f"\n{text[-6000:]}"
    assert ran + skipped >= MIN_SPECS and passed == ran, f"csi-sanity {mode}: ran {ran}, passed {passed}"
    assert not exports and not nodes, f"QSD still holds exports {sorted(exports)} and nodes {sorted(nodes)}"
    assert not left, f"csi-sanity {mode} left behind: {left}"
