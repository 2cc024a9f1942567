#!/usr/bin/env python3
"""Regenerate the gRPC bindings in csi_qsd/csi_pb/ from proto/csi.proto (CSI, what the driver serves).

Why this script exists: the generated modules are committed, so that the
driver installs and imports with nothing but the grpcio/protobuf runtimes
(no protoc at deploy time). They must therefore be reproducible from the
.proto files with one command, and tests/unit/test_proto.py calls
``generate`` into a temporary directory to prove that the committed files
never drift from them.

protoc's Python plugin emits ``import csi_pb2 as csi__pb2`` in a gRPC
module, which only works if csi_qsd/csi_pb/ is itself on sys.path; we
rewrite it into a package-relative import so ``import
csi_qsd.csi_pb.csi_pb2_grpc`` works without PYTHONPATH tricks.

Usage (from the repository root, with grpcio-tools installed):

    python scripts/gen_proto.py
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT: Path = Path(__file__).resolve().parent.parent
PROTO_DIR: Path = REPO_ROOT / "proto"
PROTO_FILES: tuple[str, ...] = ("csi.proto",)
DEFAULT_OUT_DIR: Path = REPO_ROOT / "csi_qsd" / "csi_pb"


def _well_known_include() -> Path:
    """Directory of the google/protobuf/*.proto files bundled with grpc_tools."""
    return Path(str(resources.files("grpc_tools") / "_proto"))


def modules_of(proto_file: str) -> tuple[str, str, str]:
    """The message module, its type stubs and the gRPC module protoc writes for `proto_file`."""
    stem = proto_file.removesuffix(".proto")
    return f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"


def _make_import_relative(grpc_module: Path, stem: str) -> None:
    """Turn the generated top-level import of `stem`_pb2 into a relative one."""
    absolute = f"import {stem}_pb2 as {stem.replace('_', '__')}__pb2"
    relative = f"from . {absolute}"
    lines = grpc_module.read_text(encoding="utf-8").splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == absolute]
    if len(hits) != 1:
        raise RuntimeError(
            f"expected exactly one line {absolute!r} in {grpc_module}, "
            f"found {len(hits)}: protoc's output format changed"
        )
    lines[hits[0]] = relative + "\n"
    grpc_module.write_text("".join(lines), encoding="utf-8")


def generate(out_dir: Path) -> None:
    """Compile each of PROTO_FILES into its _pb2.py, _pb2.pyi and _pb2_grpc.py in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--proto_path={_well_known_include()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with exit status {status}: {' '.join(args)}")
    for proto_file in PROTO_FILES:
        _make_import_relative(out_dir / modules_of(proto_file)[2], proto_file.removesuffix(".proto"))


def main(argv: list[str] | None = None) -> int:
    """Regenerate into csi_qsd/csi_pb/, or into the directory given as sole argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print(f"usage: {Path(__file__).name} [OUT_DIR]", file=sys.stderr)
        return 2
    out_dir = Path(args[0]) if args else DEFAULT_OUT_DIR
    generate(out_dir)
    print(f"generated {', '.join(PROTO_FILES)} bindings in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
