"""workers/ builds on app/, never the reverse: the API and the broker's rules run without the
workers package. The command line is the one exception, since it starts the workers."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
STARTS_THE_WORKERS = {APP / "cli.py"}


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_nothing_under_app_imports_workers() -> None:
    offenders = {
        str(path.relative_to(APP.parent)): sorted(
            n for n in _imported(path) if n == "workers" or n.startswith("workers.")
        )
        for path in sorted(APP.rglob("*.py"))
        if path not in STARTS_THE_WORKERS
    }
    assert {k: v for k, v in offenders.items() if v} == {}
