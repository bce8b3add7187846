"""`serve` runs Alembic only on the Postgres it started itself, or when asked (`--migrate`):
against configured services the release's `rollout-broker migrate` does it, and until then the
API answers /readyz with 503. So it does until a background worker runs, which `serve` without
workers says once at start; the zero-config `serve` runs them and becomes ready by itself."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from app.cli import NO_WORKERS
from tests.cli_process import (
    LISTENING,
    alembic_version_exists,
    broker_env,
    readyz,
    rollout_broker,
    until_ready,
)
from tests.conftest import REDIS_URL

NO_WORKER = "not ready: workers no worker is running: start `rollout-broker worker`"


async def test_serve_leaves_a_configured_database_to_migrate(
    database_factory: Callable[[], Awaitable[str]], prefix: str
) -> None:
    url = await database_factory()  # reachable, and empty
    env = broker_env(
        BROKER_REDIS_URL=REDIS_URL, BROKER_DATABASE_URL=url, BROKER_REDIS_PREFIX=prefix
    )
    await asyncio.to_thread(_serve_not_ready_then_migrate, env, url)


def _serve_not_ready_then_migrate(env: dict[str, str], url: str) -> None:
    with rollout_broker("serve", "--port", "0", env=env) as serve:
        api = serve.wait_for(LISTENING).group(1)
        resp = readyz(api)
        assert resp.status_code == 503, resp.text
        assert "migrations not at head" in resp.json()["detail"]
        assert serve.output().count(NO_WORKERS) == 1, serve.output()
        assert not alembic_version_exists(url)  # Alembic never ran
        assert serve.stop() == 0

    with rollout_broker("migrate", env=env) as migrate:
        assert migrate.exit_code() == 0, migrate.output()

    with rollout_broker("serve", "--port", "0", env=env) as serve:
        api = serve.wait_for(LISTENING).group(1)
        assert readyz(api).json()["detail"] == NO_WORKER  # migrated; no worker ever ran
        with rollout_broker("worker", env=env) as worker:
            resp = until_ready(api)
            assert resp.status_code == 200, (resp.text, worker.output())
            assert resp.json()["checks"]["workers"] == "ok"
            assert worker.stop() == 0, worker.output()
        assert readyz(api).json()["detail"] == NO_WORKER  # it left cleanly: none runs
        assert serve.stop() == 0
    assert serve.output().count(NO_WORKERS) == 1, serve.output()


async def test_serve_migrate_upgrades_a_configured_database_first(
    database_factory: Callable[[], Awaitable[str]], prefix: str
) -> None:
    url = await database_factory()
    env = broker_env(
        BROKER_REDIS_URL=REDIS_URL, BROKER_DATABASE_URL=url, BROKER_REDIS_PREFIX=prefix
    )
    await asyncio.to_thread(_serve_migrated, env, url)


def _serve_migrated(env: dict[str, str], url: str) -> None:
    with rollout_broker("serve", "--port", "0", "--migrate", env=env) as serve:
        resp = readyz(serve.wait_for(LISTENING).group(1))
        assert resp.status_code == 503, resp.text
        assert resp.json()["detail"] == NO_WORKER  # only the worker is missing
        assert alembic_version_exists(url)
        assert serve.stop() == 0


@pytest.mark.skipif(sys.platform == "win32", reason="no embedded services on Windows")
async def test_zero_config_serve_migrates_its_embedded_postgres(tmp_path: Path) -> None:
    env = broker_env()
    assert not any(k.startswith("BROKER_") for k in env)  # nothing configured: embedded
    await asyncio.to_thread(_serve_embedded, env, tmp_path / "data")


def _serve_embedded(env: dict[str, str], data_dir: Path) -> None:
    with rollout_broker("serve", "--port", "0", "--data-dir", str(data_dir), env=env) as serve:
        resp = until_ready(serve.wait_for(LISTENING, within=180).group(1))
        assert resp.status_code == 200, resp.text
        assert resp.json()["checks"]["migrations"] == "ok"
        assert resp.json()["checks"]["workers"] == "ok"  # its own, in this process
        assert serve.stop() == 0
    assert NO_WORKERS not in serve.output()
    assert os.listdir(data_dir)  # the services really were the embedded ones
