"""The database every domain shares: the declarative base and its naming convention, the engine
and session factories, and the Alembic schema helpers. The accounting and access models build on
:class:`Base`; the migrations read its metadata."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import MetaData
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.pool import NullPool

__all__ = [
    "MIGRATIONS_DIR",
    "NAMING_CONVENTION",
    "Base",
    "alembic_config",
    "create_engine",
    "create_sessionmaker",
    "downgrade",
    "schema_at_head",
    "upgrade_to_head",
    "upgrade_to_head_sync",
]

# ``migrations/`` sits beside the ``app`` package both in a checkout and once installed.
MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"


NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """The tables of every domain (accounting, access): one metadata, one naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _json_int(text: str) -> int | float:
    """A JSON integer as read back from a JSONB column: JSONB keeps a number as a numeric and
    writes 1e30 out as 1 followed by 30 zeros, so a large double stored in one (a correction's
    bound, a KL in an audit entry) comes back an integer; past 64 bits it is read as the double
    it was, which every JSON encoder can write again."""
    value = int(text)
    return value if -(2**63) <= value < 2**63 else float(value)


def _json_loads(text: str) -> Any:
    return json.loads(text, parse_int=_json_int)


def create_engine(database_url: str, **kwargs: Any) -> AsyncEngine:
    """An asyncpg engine; ``pool_pre_ping`` so a restarted Postgres costs a retry, not errors;
    JSON columns read back with :func:`_json_int`."""
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("json_deserializer", _json_loads)
    return create_async_engine(database_url, **kwargs)


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(database_url: str | None = None) -> Config:
    """An Alembic config built in code, independent of the working directory."""
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if database_url is not None:
        # ConfigParser interpolation treats '%' specially (URL-encoded passwords).
        config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def _head_revisions() -> set[str]:
    return set(ScriptDirectory.from_config(alembic_config()).get_heads())


def _current_revisions(connection: Connection) -> set[str]:
    return set(MigrationContext.configure(connection).get_current_heads())


async def schema_at_head(engine: AsyncEngine) -> bool:
    """True when the database's ``alembic_version`` equals the migration scripts' head."""
    async with engine.connect() as connection:
        current = await connection.run_sync(_current_revisions)
    return current == _head_revisions()


async def _run_command(database_url: str, fn: Any, revision: str) -> None:
    engine = create_async_engine(database_url, poolclass=NullPool)
    try:
        async with engine.begin() as connection:

            def run(sync_connection: Connection) -> None:
                config = alembic_config(database_url)
                # env.py uses this connection instead of opening its own event loop.
                config.attributes["connection"] = sync_connection
                fn(config, revision)

            await connection.run_sync(run)
    finally:
        await engine.dispose()


async def upgrade_to_head(database_url: str) -> None:
    """``alembic upgrade head`` against ``database_url`` (for ``rollout-broker migrate``)."""
    await _run_command(database_url, command.upgrade, "head")


async def downgrade(database_url: str, revision: str = "base") -> None:
    await _run_command(database_url, command.downgrade, revision)


def upgrade_to_head_sync(database_url: str) -> None:
    """The same as :func:`upgrade_to_head`, for callers without a running event loop."""
    asyncio.run(upgrade_to_head(database_url))
