"""Fixtures of the client tests: the async client over the in-process app (tests/conftest.py's
``api``), and a live broker subprocess for the blocking client and the CLI."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from rollout_broker_client import AsyncBrokerClient, BrokerClient

from tests.client.live import LiveServer, broker_env, serve
from tests.services import fresh_database, redis_prefix


@pytest.fixture
async def broker(api: httpx.AsyncClient) -> AsyncIterator[AsyncBrokerClient]:
    async with AsyncBrokerClient(http=api) as b:
        yield b


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    with redis_prefix() as prefix, fresh_database() as db, serve(broker_env(prefix, db)) as s:
        yield s


@pytest.fixture
def sync_broker(live_server: LiveServer) -> Iterator[BrokerClient]:
    with BrokerClient(live_server.url) as b:
        yield b
