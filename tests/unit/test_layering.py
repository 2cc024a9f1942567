"""The layers call downward only, and each package says what it may import.

From the bottom: errors; validate and sys; the qcow2 format; parameters; the
catalog and the pool specs; QSD; pools and publishing; export kinds; what
both ends of a copy across nodes agree on; the controller side and the node
side of the domain, side by side (neither imports the other); configuration;
the transport (TLS, UNIX sockets, the copy peers, the Kubernetes API); the
gRPC layer (`csi/`); the tools and the router that call it; the server and
metrics; the command line. A module imports only from layers below its own (or from its
own package). Each package's `__init__` docstring ends with "May import: ...":
the list must hold every package it imports and name only lower layers, so
the docstring cannot drift from the code. gRPC stays in `transport/` and above:
the QSD supervisor and the tools that only read the catalog start without
loading it (checked by importing them in a fresh interpreter).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import csi_qsd

PACKAGE = Path(csi_qsd.__file__).parent
# Bottom to top; names in one tier do not import each other.
LAYERS: list[set[str]] = [
    {"errors"},
    {"validate", "sys"},
    {"qcow2"},
    {"params"},
    {"catalog", "pool_specs"},
    {"qsd"},
    {"pools", "publish"},
    {"exports"},
    {"copy_terms"},
    {"controller", "node"},
    {"config"},
    {"transport"},
    {"csi", "csi_pb"},
    {"backup", "router"},
    {"server"},
    {"metrics"},
    {"cli"},
]
TIER = {name: i for i, names in enumerate(LAYERS) for name in names}
# csi_pb is generated: it is part of the CSI layer.
SAME_LAYER = {("csi", "csi_pb"), ("csi_pb", "csi")}
GRPC_FREE_BELOW = TIER["transport"]
MAY_IMPORT_RE = re.compile(r"^May import: ([a-z0-9_, ]+)\.$", re.M)


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def unit_of(path: Path) -> str:
    """The package or top-level module a file belongs to."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def csi_qsd_units(names: set[str]) -> set[str]:
    units = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == "csi_qsd" and len(parts) > 1 and parts[1] != "__version__":
            units.add("csi" if parts[1] == "csi_pb" else parts[1])  # generated messages: the CSI layer
    return units


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if unit_of(p) not in {"__init__"})


def test_every_package_and_module_has_a_layer() -> None:
    units = {unit_of(p) for p in sources()}
    assert units <= set(TIER), f"not in LAYERS: {sorted(units - set(TIER))}"
    assert len([p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]) <= 9, "csi_qsd/ holds too many modules"


def test_imports_go_downward_only() -> None:
    offenders = {}
    for path in sources():
        unit = unit_of(path)
        upward = sorted(other for other in csi_qsd_units(imports_of(path))
                        if other != unit and (unit, other) not in SAME_LAYER and TIER[other] >= TIER[unit])
        if upward:
            offenders[str(path.relative_to(PACKAGE))] = upward
    assert not offenders, f"imports at or above their own layer: {offenders}"


PACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "csi_pb")


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_says_what_it_may_import_and_keeps_to_it(package: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    found = MAY_IMPORT_RE.search(doc)
    assert found, f"{package}/__init__.py's docstring has no 'May import: ...' line"
    allowed = {name.strip() for name in found.group(1).split(",")}
    lower = {name for name, tier in TIER.items() if tier < TIER[package]}
    assert allowed <= lower, f"{package} claims it may import {sorted(allowed - lower)}, not below it"
    used: set[str] = set()
    for path in (PACKAGE / package).rglob("*.py"):
        used |= csi_qsd_units(imports_of(path)) - {package} - {u for u, o in SAME_LAYER if o == package}
    assert used <= allowed, f"{package} imports {sorted(used - allowed)} beyond its 'May import' line"


def test_the_node_side_imports_nothing_from_the_controller_side() -> None:
    offenders = {str(path.relative_to(PACKAGE)): sorted(name for name in imports_of(path)
                                                        if name == "csi_qsd.controller"
                                                        or name.startswith("csi_qsd.controller."))
                 for path in (PACKAGE / "node").rglob("*.py")}
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"node/ imports from controller/: {offenders}"


def test_below_the_csi_layer_nothing_imports_grpc() -> None:
    offenders = {}
    for path in sources():
        if TIER[unit_of(path)] >= GRPC_FREE_BELOW:
            continue
        bad = sorted(name for name in imports_of(path) if name == "grpc" or name.startswith("grpc."))
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = bad
    assert not offenders, f"modules below the CSI layer import gRPC: {offenders}"


def test_the_qsd_supervisor_and_config_load_no_grpc() -> None:
    probe = ("import sys, csi_qsd.qsd.daemon, csi_qsd.config, csi_qsd.node.staging, csi_qsd.controller.snapshots; "
             "print('grpc' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
