"""Fixtures of the accounting tests, on the shared ones of tests/conftest.py (the test's own
Redis prefix and database): a run id, drain contexts, and the accounting API alone."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import pytest_asyncio
from accounting_helpers import build_app
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting.drain import DrainOptions
from workers.drain import DrainContext


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
async def accounting_api(
    sessionmaker: async_sessionmaker[AsyncSession], redis: Redis, prefix: str
) -> AsyncIterator[httpx.AsyncClient]:
    """Only the accounting routes, over the test's Redis prefix and database."""
    app = build_app(sessionmaker, redis, prefix)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        yield client
