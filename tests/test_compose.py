"""The structure of docker-compose.yml and the Dockerfile it builds (no Docker engine here)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.settings import Settings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return doc


def services(compose: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = compose["services"]
    return out


def command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def test_the_services(compose: dict[str, Any]) -> None:
    assert set(services(compose)) == {"redis", "postgres", "migrate", "api", "worker"}


def test_redis_keeps_an_append_only_file(compose: dict[str, Any]) -> None:
    redis = services(compose)["redis"]
    cmd = command(redis)
    assert cmd[0] == "redis-server"
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "always"  # nothing acknowledged is lost
    assert any(v.endswith(":/data") for v in redis["volumes"])  # the AOF outlives the container
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


def test_postgres(compose: dict[str, Any]) -> None:
    pg = services(compose)["postgres"]
    assert pg["image"].startswith("postgres:")
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in pg["volumes"])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("migrate", ["rollout-broker", "migrate"]),
        ("worker", ["rollout-broker", "worker"]),
    ],
)
def test_commands(compose: dict[str, Any], name: str, expected: list[str]) -> None:
    assert command(services(compose)[name]) == expected


def test_api_listens_on_every_interface(compose: dict[str, Any]) -> None:
    api = services(compose)["api"]
    cmd = command(api)
    assert cmd[:2] == ["rollout-broker", "serve"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    port = cmd[cmd.index("--port") + 1] if "--port" in cmd else "8000"
    assert any(str(p).endswith(f":{port}") for p in api["ports"])
    probe = " ".join(api["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/readyz" in probe


@pytest.mark.parametrize("name", ["migrate", "api", "worker"])
def test_broker_environment(compose: dict[str, Any], name: str) -> None:
    svc = services(compose)[name]
    env = svc["environment"]
    assert env["BROKER_REDIS_URL"].startswith("redis://redis:6379")
    db = env["BROKER_DATABASE_URL"]
    assert db.startswith("postgresql+asyncpg://") and "@postgres:5432/" in db
    # The settings accept these values as they are.
    Settings(redis_url=env["BROKER_REDIS_URL"], database_url=db)
    assert svc["build"] == "." and svc["image"] == services(compose)["api"]["image"]


def test_start_order(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    assert svcs["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert svcs["migrate"]["restart"] == "no"  # one-shot
    for name in ("api", "worker"):
        deps = svcs[name]["depends_on"]
        assert deps["redis"] == {"condition": "service_healthy"}
        assert deps["postgres"] == {"condition": "service_healthy"}
        assert deps["migrate"] == {"condition": "service_completed_successfully"}
    for name, svc in svcs.items():
        for dep in svc.get("depends_on", {}):
            assert dep in svcs, f"{name} depends on unknown {dep}"
            if svc["depends_on"][dep]["condition"] == "service_healthy":
                assert "healthcheck" in svcs[dep], f"{dep} has no healthcheck"


def test_volumes_are_declared(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes") or {})
    for svc in services(compose).values():
        for v in svc.get("volumes", []):
            source = v.split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in named


def test_the_dockerfile_installs_the_package() -> None:
    text = (REPO / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0].startswith("FROM python:3.11")
    for folder in ("app", "workers", "migrations"):
        assert any(ln.startswith(f"COPY {folder} ") for ln in lines), folder
    assert any(ln.startswith("RUN pip install .") for ln in lines)
    assert any(ln.startswith("USER ") and "root" not in ln for ln in lines)
    assert "rollout-broker" in lines[-1] and "serve" in lines[-1]


def test_the_worker_is_healthy_while_its_heartbeat_is_fresh(compose: dict[str, Any]) -> None:
    worker = services(compose)["worker"]
    beat = worker["environment"]["BROKER_WORKER_HEARTBEAT_FILE"]
    assert Settings(worker_heartbeat_file=beat).worker_heartbeat_file is not None
    check = worker["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"] and beat in check[3]
    # The check itself, run here: fresh file healthy, stale or missing file not.
    code = check[3].replace(beat, "{path}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "beat"
        run = lambda: subprocess.run([sys.executable, "-c", code.format(path=path)]).returncode  # noqa: E731
        assert run() != 0
        path.touch()
        assert run() == 0
        old = time.time() - 120
        os.utime(path, (old, old))
        assert run() != 0
