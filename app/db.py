"""The database every domain shares: the declarative base and its naming convention, the engine
and session factories, and the Alembic schema helpers. The accounting and access models build on
:class:`Base`; the migrations read its metadata."""

from __future__ import annotations

import ast
import asyncio
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import MetaData, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.pool import NullPool

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic is imported where a migration runs, not here: importing it costs every API and worker
# process about a quarter of a second at start, where only the head check below is needed.

__all__ = [
    "MIGRATIONS_DIR",
    "NAMING_CONVENTION",
    "Base",
    "alembic_config",
    "create_engine",
    "create_sessionmaker",
    "current_revisions",
    "downgrade",
    "head_revisions",
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
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if database_url is not None:
        # ConfigParser interpolation treats '%' specially (URL-encoded passwords).
        config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


@functools.cache
def head_revisions() -> frozenset[str]:
    """The migration scripts' heads: the revisions no other script names as its
    ``down_revision``, read from ``migrations/versions`` without importing Alembic."""
    revisions: set[str] = set()
    below: set[str] = set()
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        found = _module_strings(path, ("revision", "down_revision"))
        revisions.update(found.get("revision", ()))
        below.update(found.get("down_revision", ()))
    return frozenset(revisions - below)


def _module_strings(path: Path, names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The string (or tuple of strings) each of ``names`` is assigned at the top of ``path``."""
    out: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in names:
                    value = ast.literal_eval(node.value)
                    out[target.id] = (value,) if isinstance(value, str) else tuple(value or ())
    return out


def current_revisions(connection: Connection) -> frozenset[str]:
    """The revisions in the database's ``alembic_version`` table (none without the table)."""
    if not inspect(connection).has_table("alembic_version"):
        return frozenset()
    rows = connection.execute(text("SELECT version_num FROM alembic_version"))
    return frozenset(row[0] for row in rows)


async def schema_at_head(engine: AsyncEngine) -> bool:
    """True when the database's ``alembic_version`` equals the migration scripts' head."""
    async with engine.connect() as connection:
        current = await connection.run_sync(current_revisions)
    return current == head_revisions()


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
    from alembic import command

    await _run_command(database_url, command.upgrade, "head")


async def downgrade(database_url: str, revision: str = "base") -> None:
    from alembic import command

    await _run_command(database_url, command.downgrade, revision)


def upgrade_to_head_sync(database_url: str) -> None:
    """The same as :func:`upgrade_to_head`, for callers without a running event loop."""
    asyncio.run(upgrade_to_head(database_url))
