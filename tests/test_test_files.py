"""The test files stand alone: what two of them share lives in a helper module under tests/ (not
named test_*), so no test file imports another and collecting one never runs another's module."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_test_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return [n for n in names if n.split(".")[-1].startswith("test_")]


def test_no_test_file_imports_another():
    offenders = {
        str(path.relative_to(TESTS)): found
        for path in sorted(TESTS.rglob("test_*.py"))
        if (found := _imported_test_modules(path))
    }
    assert offenders == {}


def test_the_check_sees_an_import_of_a_test_module(tmp_path):
    (tmp_path / "test_a.py").write_text("from test_b import helper\nimport os\n")
    assert _imported_test_modules(tmp_path / "test_a.py") == ["test_b"]
