"""Shared fixtures: a real Redis (127.0.0.1:6379 unless BROKER_TEST_REDIS_URL says otherwise),
a key prefix of each test's own that is deleted afterwards, and the app served in-process."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from redis.asyncio import Redis

from app.broker.store import RedisStore
from app.main import create_app
from app.settings import Settings

REDIS_URL = os.environ.get("BROKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


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
def settings(prefix: str) -> Settings:
    return Settings(redis_url=REDIS_URL, redis_prefix=prefix, max_body_bytes=1 << 20)


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            yield c
