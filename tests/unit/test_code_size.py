"""No module of the driver over 500 lines, no function over 60: a newcomer reads either in one sitting.

Counted by AST over `csi_qsd/` (the generated `csi_pb/` aside): a module by
its lines, a function from its `def` (decorators included) to its last line,
nested functions inside their own count and their enclosing one's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import csi_qsd

PACKAGE = Path(csi_qsd.__file__).parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "csi_pb" not in p.relative_to(PACKAGE).parts)


def function_lengths(source: str) -> dict[str, int]:
    """Each function's lines, by its qualified name in the module."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                lengths[prefix + child.name] = (child.end_lineno or child.lineno) - first + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def test_no_module_is_over_the_limit() -> None:
    over = {str(p.relative_to(PACKAGE)): n for p in sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_is_over_the_limit() -> None:
    over = {f"{p.relative_to(PACKAGE)}:{name}": n for p in sources()
            for name, n in function_lengths(p.read_text()).items() if n > MAX_FUNCTION_LINES}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def test_the_count_sees_a_long_method_and_its_decorator() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    lengths = function_lengths(f"class A:\n    @staticmethod\n    def long() -> None:\n{body}\n")
    assert lengths == {"A.long": MAX_FUNCTION_LINES + 2}
