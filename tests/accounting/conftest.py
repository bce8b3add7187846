"""Fixtures of the accounting tests: a database of their own (built with Alembic and dropped
at the end) and a Redis key prefix of their own (deleted at the end), on real services."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import pytest_asyncio
from accounting_helpers import REDIS_URL, build_app, delete_keys
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.accounting.db import create_engine, create_sessionmaker
from app.accounting.drain import DrainOptions
from workers.drain import DrainContext


@pytest.fixture(scope="session")
def key_root() -> str:
    return f"rbt{secrets.token_hex(4)}"


@pytest_asyncio.fixture(scope="session")
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return create_sessionmaker(engine)


@pytest_asyncio.fixture(scope="session")
async def redis(key_root: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL, decode_responses=False)
    yield client
    await delete_keys(client, key_root)
    await client.aclose()


_counter = itertools.count()


@pytest.fixture
def prefix(key_root: str) -> str:
    """A key prefix per test, under the random root shared by all the tests."""
    return f"{key_root}.{next(_counter)}"


@pytest.fixture
def run_id() -> str:
    return f"run-{secrets.token_hex(4)}"


@pytest.fixture
def make_ctx(
    redis: Redis, sessionmaker: async_sessionmaker[AsyncSession], prefix: str
) -> Callable[..., DrainContext]:
    def make(
        consumer: str | None = None, client: Redis | None = None, **options: Any
    ) -> DrainContext:
        return DrainContext.create(
            client or redis,
            sessionmaker,
            prefix,
            DrainOptions(**options),
            consumer,
        )

    return make


@pytest_asyncio.fixture
async def api(
    sessionmaker: async_sessionmaker[AsyncSession], redis: Redis, prefix: str
) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(sessionmaker, redis, prefix)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        yield client
