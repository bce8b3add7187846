"""Fixtures of the client tests: the async client over the in-process app (tests/conftest.py's
``api``), directly or through a :class:`Recorder`, and a live broker subprocess for the blocking
client and the CLI."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from rollout_broker_client import AsyncBrokerClient, BrokerClient, Retry

from tests.client.live import LiveServer, broker_env, serve
from tests.client.recorder import Recorder
from tests.services import fresh_database, redis_prefix


@pytest.fixture
async def broker(api: httpx.AsyncClient) -> AsyncIterator[AsyncBrokerClient]:
    async with AsyncBrokerClient(http=api) as b:
        yield b


@pytest.fixture
def recorder(api: httpx.AsyncClient) -> Recorder:
    return Recorder(api._transport)


@pytest.fixture
async def wired(recorder: Recorder) -> AsyncIterator[AsyncBrokerClient]:
    """The async client through the recorder, retrying at once."""
    http = httpx.AsyncClient(transport=recorder, base_url="http://broker")
    async with AsyncBrokerClient(http=http, retry=Retry(retries=2, backoff_s=0.001)) as b:
        yield b
    await http.aclose()


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    with redis_prefix() as prefix, fresh_database() as db, serve(broker_env(prefix, db)) as s:
        yield s


@pytest.fixture
def sync_broker(live_server: LiveServer) -> Iterator[BrokerClient]:
    with BrokerClient(live_server.url) as b:
        yield b
