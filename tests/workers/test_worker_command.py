"""`rollout-broker worker`, the one way to run the workers on their own: it drains the event
streams into Postgres, takes every worker setting from Settings (the ``BROKER_DRAIN_*``
variables included), and refuses a database that is not migrated unless told to migrate it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis
from sqlalchemy import select
from typer.testing import CliRunner

from app.accounting.drain import DrainOptions
from app.accounting.models import RunTotals
from app.broker.config import RunConfig
from app.cli import cli
from app.db import create_engine, create_sessionmaker
from app.settings import Settings
from app.wiring import broker_for
from tests.broker.test_store import packed
from tests.cli_process import REPO, alembic_version_exists, broker_env, rollout_broker
from tests.conftest import REDIS_URL


async def _rollouts_received(database_url: str, run_id: str, want: int, within: float) -> None:
    """Poll the run's accounting row until it counts ``want`` rollouts."""
    engine = create_engine(database_url)
    sessions = create_sessionmaker(engine)
    deadline = time.monotonic() + within
    try:
        while True:
            async with sessions() as s:
                got = await s.scalar(
                    select(RunTotals.rollouts_received).where(RunTotals.run_id == run_id)
                )
            if got == want:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{run_id}: rollouts_received is {got}, not {want}")
            await asyncio.sleep(0.05)
    finally:
        await engine.dispose()


async def test_the_worker_command_drains_events_into_postgres(
    redis: Redis, prefix: str, database_url: str
) -> None:
    broker = broker_for(redis, Settings(redis_url=REDIS_URL, redis_prefix=prefix))
    run_id = f"w-{uuid.uuid4().hex[:8]}"
    await broker.store.create_run(run_id, RunConfig())
    await broker.store.ingest(run_id, [packed("a"), packed("b")])
    env = broker_env(
        BROKER_REDIS_URL=REDIS_URL, BROKER_DATABASE_URL=database_url, BROKER_REDIS_PREFIX=prefix
    )
    with rollout_broker("worker", env=env) as worker:
        await _rollouts_received(database_url, run_id, 2, within=30)
        assert worker.proc.poll() is None, worker.output()
        # SIGTERM (what `docker stop` sends) ends it cleanly.
        assert await asyncio.to_thread(worker.stop, signal.SIGTERM) == 0, worker.output()


async def test_the_worker_refuses_a_database_not_at_head_unless_told_to_migrate(
    database_factory: Callable[[], Awaitable[str]], prefix: str, tmp_path: Path
) -> None:
    url = await database_factory()  # empty: never migrated
    env = broker_env(
        BROKER_REDIS_URL=REDIS_URL,
        BROKER_DATABASE_URL=url,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_WORKER_HEARTBEAT_FILE=str(tmp_path / "beat"),
    )
    await asyncio.to_thread(_refuse_then_migrate, env, url, tmp_path / "beat")


def _refuse_then_migrate(env: dict[str, str], url: str, beat: Path) -> None:
    with rollout_broker("worker", env=env) as worker:
        assert worker.exit_code() == 2, worker.output()
        assert "rollout-broker migrate" in worker.output()
    assert not alembic_version_exists(url)
    assert not beat.exists()

    with rollout_broker("worker", "--migrate", env=env) as worker:
        deadline = time.monotonic() + 30
        while not beat.exists():  # the sweep and the drain have both passed once
            assert worker.proc.poll() is None, worker.output()
            assert time.monotonic() < deadline, worker.output()
            time.sleep(0.02)
        assert worker.stop(signal.SIGTERM) == 0, worker.output()
    assert alembic_version_exists(url)


def test_python_m_workers_drain_is_gone() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "workers.drain"],
        cwd=REPO,
        env=broker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0  # not a silent success that a restart policy would loop on
    assert "rollout-broker worker" in done.stderr


def test_the_worker_takes_its_settings_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Settings] = []

    async def fake_workers(settings: Settings, stop: asyncio.Event) -> None:
        seen.append(settings)

    monkeypatch.setattr("workers.runner.run_workers", fake_workers)
    for name in [k for k in os.environ if k.startswith("BROKER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BROKER_REDIS_URL", REDIS_URL)  # no database: no schema check
    monkeypatch.setenv("BROKER_SWEEP_INTERVAL_S", "0.25")
    monkeypatch.setenv("BROKER_DRAIN_BATCH_SIZE", "17")
    monkeypatch.setenv("BROKER_DRAIN_CONSUMER", "drain-a")
    runner = CliRunner()
    assert runner.invoke(cli, ["worker"]).exit_code == 0
    assert runner.invoke(cli, ["worker", "--interval", "2"]).exit_code == 0
    first, second = seen
    assert first.sweep_interval_s == 0.25  # the setting, not a default of the command's own
    assert second.sweep_interval_s == 2.0  # the option wins
    assert DrainOptions.from_settings(first).batch_size == 17
    assert first.drain_consumer == "drain-a"


def test_every_documented_drain_variable_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/accounting.md names the drain's variables; each sets the field it names."""
    docs = (REPO / "docs" / "accounting.md").read_text()
    names = re.findall(r"^\| `(BROKER_DRAIN_[A-Z_]+)` \|", docs, flags=re.MULTILINE)
    assert len(names) >= 7, names
    expected = {}
    for name in names:
        field = name.removeprefix("BROKER_").lower()
        assert field in Settings.model_fields, f"{name} is documented but is no setting"
        kind = Settings.model_fields[field].annotation
        # 13, or just above the field's lower bound where that is higher
        floor = max(
            (getattr(m, "ge", 0) or 0 for m in Settings.model_fields[field].metadata), default=0
        )
        n = 13 if floor <= 13 else floor + 13
        raw, value = {bool: ("false", False), int: (str(n), n), int | None: (str(n), n)}.get(
            kind, ("c-1", "c-1")
        )
        monkeypatch.setenv(name, raw)
        expected[field] = value
    settings = Settings()
    options = DrainOptions.from_settings(settings)
    for field, value in expected.items():
        assert getattr(settings, field) == value, field
        option = field.removeprefix("drain_")
        if option != "consumer":  # the consumer's name is the drainer's, not an option
            assert getattr(options, option) == value, f"{field} does not reach the drain"
