"""The layers of app/, held against its imports:

- the three domains (broker, accounting, access) never import each other; what they share (the
  key layout, the event schema, the database base, ids, the caller, errors, settings) sits at the
  top of app/ and imports no domain; the composition root (app/main.py) wires them;
- app/api is the HTTP transport: it knows no domain, and the domains reach it through its public
  face (``app.api``), never its private modules (``app.api._*``); each domain's part of the API
  description reaches it through the composition root;
- workers/ builds on app/, never the reverse, but for the command that starts the workers;
- no module of app/ is over 500 lines and no function over 80 (the client's own layering is
  tests/client/test_cli_package.py's)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "app" / "api"
APP = ROOT / "app"
DOMAINS = ("app.broker", "app.accounting", "app.access")
SHARED = ("app.keys", "app.events", "app.db", "app.ids", "app.caller", "app.errors", "app.settings",
          "app.replicas", "app.functions",
          "app.pubsub", "app.allocator", "app.api")  # fmt: skip
STARTS_THE_WORKERS = {APP / "cli.py"}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
SOURCES = ("app", "workers", "benchmarks")  # every package but the tests


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, by absolute name."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    return imported_by(path.read_text(), package, str(path))


def imported_by(source: str, package: str, filename: str = "<source>") -> set[str]:
    """Every module ``source`` (a module of ``package``) imports, by absolute name; ``from a
    import b`` counts as ``a`` and ``a.b`` (b may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def sources() -> Iterator[Path]:
    for top in SOURCES:
        yield from sorted((ROOT / top).rglob("*.py"))


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_the_domains_never_import_each_other() -> None:
    offenders = {}
    for domain in DOMAINS:
        for path in sorted((ROOT / domain.replace(".", "/")).rglob("*.py")):
            others = [d for d in DOMAINS if d != domain]
            found = sorted(n for n in imported(path) if any(within(n, d) for d in others))
            if found:
                offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


def test_the_shared_modules_import_no_domain() -> None:
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in sorted(APP.rglob("*.py"))
        if any(within(module_of(path), s) for s in SHARED)
        and (found := sorted(n for n in imported(path) if any(within(n, d) for d in DOMAINS)))
    }
    assert offenders == {}


def test_nothing_under_app_imports_workers() -> None:
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in sorted(APP.rglob("*.py"))
        if path not in STARTS_THE_WORKERS
        and (found := sorted(n for n in imported(path) if within(n, "workers")))
    }
    assert offenders == {}


def test_modules_and_functions_of_app_stay_small() -> None:
    too_long = []
    for path in sorted(APP.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {n} lines")
    assert too_long == []


def test_app_api_imports_no_domain() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            n for n in imported(path) if any(within(n, d) for d in DOMAINS)
        )
        for path in sorted(API.rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_module_outside_app_api_imports_its_private_modules() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(n for n in imported(path) if n.startswith("app.api._"))
        for path in sources()
        if not path.is_relative_to(API)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize(
    ("line", "name"),
    [
        ("import app.broker.service", "app.broker.service"),
        ("from app import accounting", "app.accounting"),
        ("from app.access.policy import need_of", "app.access.policy"),
        ("from .. import broker", "app.broker"),
        ("from ..access import policy", "app.access.policy"),
        ("from app.api import _codec", "app.api._codec"),
        ("from app.api._openapi import describe", "app.api._openapi"),
        ("if True:\n    import app.api._state", "app.api._state"),
    ],
)
def test_the_checks_see_every_form_of_import(line: str, name: str) -> None:
    assert name in imported_by(line, "app.api")
