"""The Redis and Postgres the tests run against, and how each test gets a namespace of its own.

Redis is ``BROKER_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``), and the Redis
Cluster any node of ``BROKER_TEST_REDIS_CLUSTER_URL`` (unset: the tests start one); Postgres is the
server at ``BROKER_TEST_PG_URL`` (default ``postgresql://postgres@127.0.0.1:5432``, trust auth),
whose user may create databases. Every key a test writes starts with a prefix of its own
(``rbt<hex>:``), deleted afterwards. The databases are ``rbt_<hex>``, made for the tests and
dropped afterwards: a test has the migrated one to itself and leaves it empty (a new database per
test would cost a second each on a busy server), and a live broker or a migration test gets new
ones. The fixtures in ``tests/conftest.py`` and the broker subprocesses of
``tests/client/live.py`` both go through here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg
import redis
from redis.asyncio import Redis

from app.settings import Settings
from app.wiring import redis_client

REDIS_URL = os.environ.get("BROKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CLUSTER_URL = os.environ.get("BROKER_TEST_REDIS_CLUSTER_URL")  # None: the tests start their own
PG_URL = os.environ.get("BROKER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432").rstrip("/")

# The broker's fallback re-check in tests, far beyond the longest long poll (BROKER_MAX_WAIT_S):
# a waiting lease then answers early only when a pub/sub wake-up reaches it.
WAKE_FALLBACK_S = 3600.0

KEY_PREFIX = "rbt"  # of every test's key prefix
DATABASE_PREFIX = "rbt_"  # of every test database's name


@dataclass(frozen=True)
class RedisBackend:
    """The Redis a test runs on: one node, or any node of a cluster."""

    url: str
    cluster: bool

    def client(self) -> Redis:
        """The broker's own kind of client for this Redis (app/wiring.py)."""
        return redis_client(Settings(redis_url=self.url, redis_cluster=self.cluster))

    def env(self) -> dict[str, str]:
        """The ``BROKER_*`` variables of a broker process on this Redis."""
        return {"BROKER_REDIS_URL": self.url, "BROKER_REDIS_CLUSTER": str(int(self.cluster))}


def new_prefix() -> str:
    return f"{KEY_PREFIX}{uuid.uuid4().hex[:10]}"


def url_of_database(name: str) -> str:
    """The SQLAlchemy async URL of database ``name`` on the test server."""
    return f"postgresql+asyncpg://{PG_URL.split('://', 1)[1]}/{name}"


async def create_database() -> str:
    """A new, empty database; returns its name."""
    name = f"{DATABASE_PREFIX}{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(f"{PG_URL}/postgres")
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return name


async def drop_database(name: str) -> None:
    conn = await asyncpg.connect(f"{PG_URL}/postgres")
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


_TABLES = (
    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'"
)


async def empty_database(name: str) -> None:
    """Delete every row of every table but Alembic's (the schema has no foreign keys, so the
    order does not matter): much quicker than a new database, and as clean for the next test."""
    conn = await asyncpg.connect(f"{PG_URL}/{name}")
    try:
        async with conn.transaction():
            for (table,) in await conn.fetch(_TABLES):
                await conn.execute(f'DELETE FROM "{table}"')
    finally:
        await conn.close()


async def rows_left(name: str) -> dict[str, int]:
    """The tables of the database that hold rows, with their counts."""
    conn = await asyncpg.connect(f"{PG_URL}/{name}")
    try:
        counts = {
            t: await conn.fetchval(f'SELECT count(*) FROM "{t}"')
            for (t,) in await conn.fetch(_TABLES)
        }
    finally:
        await conn.close()
    return {t: n for t, n in counts.items() if n}


async def delete_prefix(client: Redis, prefix: str) -> None:
    """Delete every key under ``prefix``."""
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
    for i in range(0, len(keys), 500):
        await client.delete(*keys[i : i + 500])


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """For code without an event loop: a new, empty database, dropped afterwards; yields its
    SQLAlchemy async URL."""
    name = asyncio.run(create_database())
    try:
        yield url_of_database(name)
    finally:
        asyncio.run(drop_database(name))


@contextlib.contextmanager
def redis_prefix() -> Iterator[str]:
    """For code without an event loop: a new key prefix, its keys deleted afterwards."""
    prefix = new_prefix()
    try:
        yield prefix
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
        client.close()
