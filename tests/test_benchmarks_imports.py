"""The benchmark's modules import one another without a cycle: the sections in
benchmarks/sections/ sit over the shared harness and helpers of benchmarks/, and no section
imports another. Every import counts, also one inside a function or under TYPE_CHECKING."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "benchmarks"
SECTIONS = f"{PACKAGE}.sections"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package, with the modules of the package it imports."""
    files = {_module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    up = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join([*up, base] if base else up)
                deps.add(base)
                # `from benchmarks import load` imports the module benchmarks.load
                deps.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def test_benchmarks_have_no_import_cycle() -> None:
    graph = import_graph()
    assert f"{PACKAGE}.run" in graph and f"{SECTIONS}.cluster" in graph, sorted(graph)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail("benchmarks/ imports in a cycle: " + " -> ".join(e.args[1]))


def test_no_section_imports_another_or_the_entry_point() -> None:
    graph = import_graph()
    sections = {m for m in graph if m.startswith(f"{SECTIONS}.")}
    assert len(sections) >= 12, sorted(sections)
    for section in sorted(sections):
        others = {d for d in graph[section] if d.startswith(f"{SECTIONS}.")}
        assert not others, f"{section} imports other sections: {sorted(others)}"
        assert f"{PACKAGE}.run" not in graph[section], f"{section} imports benchmarks.run"
    shared = {m for m in graph if not m.startswith(SECTIONS) and m != f"{PACKAGE}.run"}
    for module in sorted(shared - {f"{PACKAGE}.__main__"}):
        upward = {d for d in graph[module] if d.startswith(SECTIONS) or d == f"{PACKAGE}.run"}
        assert not upward, f"{module} (shared) imports {sorted(upward)}"
