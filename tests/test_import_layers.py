"""The package's import graph, read from the source (no import runs): no circles, and no import from
a lower floor to a higher one.

A module's imports are its ``import`` / ``from ... import`` statements outside ``TYPE_CHECKING``
blocks. Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, so for the circle check an
edge to ``a.b.c`` is also an edge to every package above it that the importer is not itself inside.
Imports inside functions run later, when every module is loaded: they cannot form a circle at
import time, but they must still respect the floors.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_lite"

# Lowest first. A module's floor is that of the longest prefix listed.
FLOORS = {
    "megatron_lite.utils": 0,
    "megatron_lite.core": 1,
    "megatron_lite.models": 2,
    "megatron_lite.peft": 2,  # LoRA's layers over core's; the config and the loop apply them
    "megatron_lite.training.errors": 2,  # bad input, raised by every floor above
    "megatron_lite.training.tokenizers": 3,
    "megatron_lite.data": 4,
    "megatron_lite.training.config": 5,  # the typed config and its validation
    "megatron_lite.training.cli": 5,  # the flag table and ranges, which the validation names
    "megatron_lite.training.cli.parser": 7,  # reads a checkpoint's config (--use-checkpoint-args)
    "megatron_lite.training.memory": 6,  # measurement, attribution and prediction: below the loop
    "megatron_lite.training.metrics": 6,  # a step's metrics, the sinks and the console line: below the loop
    "megatron_lite.training": 7,  # the loop, its set-up, state, checkpoints, logging
    "megatron_lite.recipes": 8,
    "megatron_lite.bridge": 8,  # Hugging Face models in and out: above training (it writes checkpoints)
    "megatron_lite.run_modes": 8,  # the preflight and its dry run: they run the loop
    "megatron_lite": 9,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def _imports(tree: ast.Module, mods, package: str) -> tuple[set[str], set[str]]:
    """(module-level targets, targets imported inside functions); ``package`` resolves relative ones."""
    top, late = set(), set()

    def visit(body, at_top: bool) -> None:
        for node in body:
            if isinstance(node, ast.If) and _type_checking(node):
                visit(node.orelse, at_top)  # the else branch runs
                continue
            if isinstance(node, ast.Import):
                (top if at_top else late).update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's package, up level - 1
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in mods else base
                    if target in mods:
                        (top if at_top else late).add(target)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(node.body, False)
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child], at_top)
                    elif isinstance(child, (ast.excepthandler, ast.match_case)):
                        visit(child.body, at_top)

    visit(tree.body, True)
    return top, late


def _graph():
    mods = _modules()
    top, late = {}, {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        top[name], late[name] = _imports(ast.parse(path.read_text()), mods, package)
        top[name].discard(name)
    return mods, top, late


def _floor(name: str) -> int:
    return FLOORS[max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)]


def test_no_import_circles():
    _assert_no_circles(late_too=False)


def test_no_circles_through_function_level_imports_either():
    """A function-level import cannot break an import at load time, but a circle through one is still
    two modules that each need the other: there are none."""
    _assert_no_circles(late_too=True)


def _assert_no_circles(late_too: bool) -> None:
    mods, top, late = _graph()
    edges = {}
    for name, targets in top.items():
        if late_too:
            targets = targets | (late[name] - {name})
        # A package the importer sits in is mid-import already: only a direct import of it is an edge.
        own = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 2)}
        implied = set()
        for target in targets:
            parts = target.split(".")
            implied.update(".".join(parts[:k]) for k in range(1, len(parts)))
        edges[name] = set(targets) | {t for t in implied if t in mods and t not in own}
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def strongly_connect(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongly_connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strongly_connect(v)
    assert circles == []


def test_no_import_from_a_lower_floor_to_a_higher_one():
    _, top, late = _graph()
    upward = sorted(
        f"{name} -> {target}"
        for name in top
        for target in top[name] | late[name]
        if _floor(target) > _floor(name)
    )
    assert upward == []


def _fake_package(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """Write ``files`` as a package named megatron_lite under ``tmp_path`` and point the checks at it."""
    pkg = tmp_path / "megatron_lite"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)


def test_the_checker_sees_circles_and_floors(tmp_path, monkeypatch):
    """The two checks above fail on a package that has a circle through a package's __init__ and an
    upward import."""
    _fake_package(
        tmp_path,
        monkeypatch,
        {
            "__init__.py": "",
            "core/__init__.py": "from megatron_lite.core.a import A\n",
            "core/a.py": "A = 1\nfrom ..training.b import B\n",  # relative, and upward
            "training/__init__.py": "",
            "training/b.py": "from megatron_lite.core.a import A\nB = 2\n",
        },
    )
    _, top, _ = _graph()
    assert top["megatron_lite.core.a"] == {"megatron_lite.training.b"}
    try:
        test_no_import_from_a_lower_floor_to_a_higher_one()
    except AssertionError:
        pass
    else:
        raise AssertionError("the upward import core.a -> training.b was not seen")
    try:
        test_no_import_circles()
    except AssertionError:
        pass
    else:
        raise AssertionError("the circle core.a -> training.b -> core.a was not seen")


def test_the_checker_sees_a_circle_through_the_importers_own_package(tmp_path, monkeypatch):
    """``core/b.py`` importing its own package, whose ``__init__`` imports ``core/b.py``."""
    _fake_package(
        tmp_path,
        monkeypatch,
        {
            "__init__.py": "",
            "core/__init__.py": "from megatron_lite.core.b import B\nA = 1\n",
            "core/b.py": "from megatron_lite.core import A\nB = 2\n",
        },
    )
    try:
        test_no_import_circles()
    except AssertionError:
        return
    raise AssertionError("the circle core -> core.b -> core was not seen")
