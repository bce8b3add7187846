"""Migrations on a real database: up, down, up again; the models match the migrations."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

import app.access.models  # noqa: F401  (the access tables share the metadata)
from app.db import (
    MIGRATIONS_DIR,
    Base,
    alembic_config,
    create_engine,
    current_revisions,
    downgrade,
    head_revisions,
    schema_at_head,
    upgrade_to_head,
    upgrade_to_head_sync,
)

TABLES = {
    "runs",
    "run_totals",
    "version_totals",
    "reason_totals",
    "lag_counts",
    "batches",
    "processed_events",
    "api_tokens",
    "audit_log",
    "prompt_passes",
    "training_totals",
    "reward_latency_counts",
    "generator_totals",
    "length_counts",
    "prompt_means",
    "consumer_totals",
}


def _tables(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names())


def _diff(connection: Connection) -> list[object]:
    """What Alembic finds different, and the column collations, which it does not compare."""
    diff = list(compare_metadata(MigrationContext.configure(connection), Base.metadata))
    inspector = inspect(connection)
    for table in Base.metadata.sorted_tables:
        reflected = {c["name"]: c["type"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            declared = getattr(column.type, "collation", None)
            found = getattr(reflected.get(column.name), "collation", None)
            if declared != found:
                diff.append(("collation", table.name, column.name, declared, found))
    return diff


def test_the_heads_read_without_alembic_are_alembics() -> None:
    assert head_revisions() == set(ScriptDirectory.from_config(alembic_config()).get_heads())


async def test_the_revisions_read_without_alembic_are_alembics(
    database_factory: Callable[[], Awaitable[str]],
) -> None:
    """What the head check at start reads from ``alembic_version`` (no table, the head, a
    revision below it) is what Alembic itself reads."""
    url = await database_factory()
    engine = create_engine(url)

    def both(connection: Connection) -> tuple[frozenset[str], set[str]]:
        alembic = set(MigrationContext.configure(connection).get_current_heads())
        return current_revisions(connection), alembic

    try:
        seen = []
        for step in (None, upgrade_to_head, "0002_prompt_passes"):
            if step is upgrade_to_head:
                await upgrade_to_head(url)
            elif isinstance(step, str):
                await downgrade(url, step)
            async with engine.connect() as conn:
                ours, theirs = await conn.run_sync(both)
            assert ours == theirs, step
            seen.append(ours)
        assert seen == [set(), head_revisions(), {"0002_prompt_passes"}]
    finally:
        await engine.dispose()


async def test_upgrade_downgrade_upgrade(database_factory: Callable[[], Awaitable[str]]) -> None:
    url = await database_factory()
    engine = create_engine(url)
    try:
        assert not await schema_at_head(engine)

        await upgrade_to_head(url)
        assert await schema_at_head(engine)
        async with engine.connect() as conn:
            assert await conn.run_sync(_tables) == TABLES | {"alembic_version"}
            assert await conn.run_sync(_diff) == []

        await downgrade(url, "base")
        assert not await schema_at_head(engine)
        async with engine.connect() as conn:
            assert await conn.run_sync(_tables) == {"alembic_version"}

        # Again through the sync helper (what `rollout-broker migrate` may call).
        await asyncio.to_thread(upgrade_to_head_sync, url)
        assert await schema_at_head(engine)
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO processed_events (run_id, stream_ms, stream_seq, event_type)"
                    " VALUES ('r', 1, 0, 'run')"
                )
            )
            assert await conn.run_sync(_diff) == []

        # Idempotent: at head, upgrading again changes nothing.
        await upgrade_to_head(url)
        assert await schema_at_head(engine)
    finally:
        await engine.dispose()


@pytest.mark.slow
async def test_alembic_command_line_from_any_directory(
    database_factory: Callable[[], Awaitable[str]], tmp_path: object
) -> None:
    """``alembic -c migrations/alembic.ini`` reads BROKER_DATABASE_URL and needs no cwd."""
    url = await database_factory()
    env = {**os.environ, "BROKER_DATABASE_URL": url}
    ini = str(MIGRATIONS_DIR / "alembic.ini")
    for args in (["upgrade", "head"], ["downgrade", "base"], ["upgrade", "head"]):
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "alembic", "-c", ini, *args],
            env=env,
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
    engine = create_engine(url)
    try:
        assert await schema_at_head(engine)
    finally:
        await engine.dispose()


async def test_live_token_names_become_unique_without_losing_a_token(
    database_factory: Callable[[], Awaitable[str]],
) -> None:
    """Tokens made before names were unique: the oldest live token of a name keeps it, later
    ones and those with a reserved name are renamed ``<name>-<token_id>``; revoked ones keep
    theirs."""
    url = await database_factory()
    await upgrade_to_head(url)
    await downgrade(url, "0005_training_totals")
    rows = [  # token_id, name, seconds after the first, revoked
        ("a1", "ops", 0, False),
        ("a2", "ops", 1, False),
        ("a3", "ops", 2, True),
        ("b1", "bootstrap", 3, False),
        ("c1", "solo", 4, False),
    ]
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            for token_id, name, after, revoked in rows:
                await conn.execute(
                    text(
                        "INSERT INTO api_tokens (token_id, name, scopes, secret_sha256,"
                        " created_at, created_by, revoked_at) VALUES (:id, :name, '{train}',"
                        " '\\x00', now() + make_interval(secs => :after), 'test',"
                        " CASE WHEN :revoked THEN now() END)"
                    ),
                    {"id": token_id, "name": name, "after": after, "revoked": revoked},
                )
        await upgrade_to_head(url)
        async with engine.connect() as conn:
            names = dict((await conn.execute(text("SELECT token_id, name FROM api_tokens"))).all())
        assert names == {
            "a1": "ops",
            "a2": "ops-a2",
            "a3": "ops",
            "b1": "bootstrap-b1",
            "c1": "solo",
        }
    finally:
        await engine.dispose()


async def test_rewards_upgrade_keeps_the_totals_and_starts_the_reward_counts_at_zero(
    database_factory: Callable[[], Awaitable[str]],
) -> None:
    """0010_rewards on a database with totals: the rows keep every figure, the reward counts
    start at 0 per run and per version, and the latency histogram's table takes rows."""
    url = await database_factory()
    await upgrade_to_head(url)
    await downgrade(url, "0009_rewind")
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text("INSERT INTO run_totals (run_id, rollouts_received) VALUES ('r', 7)")
            )
            await conn.execute(
                text(
                    "INSERT INTO version_totals (run_id, policy_version, rollouts_received)"
                    " VALUES ('r', 3, 7)"
                )
            )
        await upgrade_to_head(url)
        assert await schema_at_head(engine)
        rewards = (
            "rollouts_received, rewards_awaiting, rewards_leased, rewards_scored, rewards_timed_out"
        )
        async with engine.begin() as conn:
            run = (
                await conn.execute(text(f"SELECT {rewards}, reward_wait_ms FROM run_totals"))
            ).one()
            version = (await conn.execute(text(f"SELECT {rewards} FROM version_totals"))).one()
            await conn.execute(
                text("INSERT INTO reward_latency_counts (run_id, bound_ms) VALUES ('r', 100)")
            )
            latency = (await conn.execute(text("SELECT scores FROM reward_latency_counts"))).one()
        assert tuple(run) == (7, 0, 0, 0, 0, 0)
        assert tuple(version) == (7, 0, 0, 0, 0)
        assert tuple(latency) == (0,)
        await downgrade(url, "0009_rewind")
        async with engine.connect() as conn:
            assert "reward_latency_counts" not in await conn.run_sync(_tables)
    finally:
        await engine.dispose()
