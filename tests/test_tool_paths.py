"""The benchmarks and scripts run as their docs say, `python benchmarks/X.py` from a checkout:
Python then puts only the script's own folder on the path, so a module-level import of the
repository's `tests` package or of a sibling benchmark (`bench_*`) needs a `sys.path.insert`
before it (bench_audit_labels.py once failed so at its first line). Read from the source, not
run: running each takes seconds of imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")])


def _needs_path(module: str) -> bool:
    """Importable only with the repository root (tests) or benchmarks/ (bench_*) on the path."""
    top = module.split(".")[0]
    return top == "tests" or top.startswith("bench_")


def _unpathed_imports(path: Path) -> list[str]:
    """Module-level imports of `tests` or `bench_*` that no earlier `sys.path.insert` precedes."""
    inserted, late = False, []
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "sys.path.insert"):
            inserted = True
        elif isinstance(node, ast.ImportFrom) and node.module and not inserted:
            late += [node.module] if _needs_path(node.module) else []
        elif isinstance(node, ast.Import) and not inserted:
            late += [a.name for a in node.names if _needs_path(a.name)]
    return late


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_tool_puts_the_repository_on_its_path_before_importing_from_it(path: Path) -> None:
    assert not _unpathed_imports(path), f"{path.name}: add sys.path.insert before these imports"


def test_the_check_finds_an_import_without_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "bench_x.py"
    bad.write_text("import sys\nfrom tests.servers import orca_result\n"
                   "sys.path.insert(0, '.')\nimport bench_samples\n")
    assert _unpathed_imports(bad) == ["tests.servers"]
