"""The layers call downward only: gRPC and the CSI messages stay in the outer layer.

`csi/` turns CSI calls into domain calls; the domain (volumes, snapshots,
staging, ...) and everything below it (`qsd/`, `pools/`, `exports/`,
`publish/`, `sys/`, the catalog, config) know nothing of gRPC, so the QSD
supervisor, the pools and the tools that only read the catalog start
without loading it. Checked by reading every module's imports (static), and
by importing the supervisor in a fresh interpreter (what it really loads).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import csi_qsd

PACKAGE = Path(csi_qsd.__file__).parent
# The outer layer: serving and calling CSI over gRPC, and the entry points that wire it.
OUTER = {
    "csi", "csi_pb", "router", "server", "cli", "csi_client", "metadata_listener", "tls", "metrics", "backup",
}
OUTER_IMPORTS = ("grpc", "csi_qsd.csi.", "csi_qsd.csi_pb", "csi_qsd.csi_client", "csi_qsd.server",
                 "csi_qsd.router", "csi_qsd.metadata_listener", "csi_qsd.tls", "csi_qsd.cli")


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_domain_and_below_import_nothing_of_grpc_or_csi() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if top in OUTER:
            continue
        bad = sorted(name for name in imports_of(path)
                     if name == "grpc" or any(name.startswith(prefix) for prefix in OUTER_IMPORTS)
                     or name in {"csi_qsd.csi", "csi_qsd.router"})
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = bad
    assert not offenders, f"modules below the CSI layer import it: {offenders}"


def test_the_qsd_supervisor_and_config_load_no_grpc() -> None:
    probe = "import sys, csi_qsd.qsd.daemon, csi_qsd.config, csi_qsd.staging; print('grpc' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
