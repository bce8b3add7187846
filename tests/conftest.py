"""Shared fixtures on real services: Redis (127.0.0.1:6379 unless BROKER_TEST_REDIS_URL says
otherwise) with a key prefix of each test's own that is deleted afterwards; Postgres
(127.0.0.1:5432, trust auth) with a database of the session's own, built by Alembic and dropped
at the end; and the app served in-process."""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import httpx
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from app.accounting.db import upgrade_to_head
from app.broker.store import RedisStore
from app.main import create_app
from app.settings import Settings

REDIS_URL = os.environ.get("BROKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_HOST = os.environ.get("BROKER_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("BROKER_TEST_PG_PORT", "5432"))


async def _admin_user() -> str:
    """The first of the usual superusers that the local (trust) Postgres lets in."""
    errors = []
    for user in (os.environ.get("BROKER_TEST_PG_USER"), "postgres", "root"):
        if not user:
            continue
        try:
            conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=user, database="postgres")
        except Exception as exc:
            errors.append(f"{user}: {exc}")
            continue
        await conn.close()
        return user
    raise RuntimeError(f"no Postgres superuser at {PG_HOST}:{PG_PORT}: {errors}")


@pytest_asyncio.fixture(scope="session")
async def pg_user() -> str:
    return await _admin_user()


@pytest_asyncio.fixture(scope="session")
async def database_factory(pg_user: str) -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """Creates empty databases (``rb_test_<hex>``) and drops them all at the end."""
    created: list[str] = []

    async def create() -> str:
        name = f"rb_test_{secrets.token_hex(6)}"
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=pg_user, database="postgres")
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        created.append(name)
        return f"postgresql+asyncpg://{pg_user}@{PG_HOST}:{PG_PORT}/{name}"

    yield create
    conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=pg_user, database="postgres")
    try:
        for name in created:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest_asyncio.fixture(scope="session")
async def database_url(database_factory: Callable[[], Awaitable[str]]) -> str:
    url = await database_factory()
    await upgrade_to_head(url)
    return url


async def delete_prefix(redis: Redis, prefix: str) -> None:
    keys = [k async for k in redis.scan_iter(match=f"{prefix}:*", count=1000)]
    for i in range(0, len(keys), 500):
        await redis.delete(*keys[i : i + 500])


@pytest.fixture
async def redis() -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL, decode_responses=False)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis: Redis) -> AsyncIterator[str]:
    p = f"rbt{uuid.uuid4().hex[:10]}"
    yield p
    await delete_prefix(redis, p)


@pytest.fixture
def store(redis: Redis, prefix: str) -> RedisStore:
    return RedisStore(redis, prefix)


@pytest.fixture
def settings(prefix: str, database_url: str) -> Settings:
    return Settings(
        redis_url=REDIS_URL,
        database_url=database_url,
        redis_prefix=prefix,
        max_body_bytes=1 << 20,
    )


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            yield c
