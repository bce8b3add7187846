"""Liveness and readiness: /readyz is false until Postgres is migrated to head, and while no
background worker has drained the accounting within the last minute."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.accounting.consumers import ALIVE_WITHIN_S
from app.accounting.drain import DrainOptions
from app.db import upgrade_to_head
from app.main import create_app
from app.settings import Settings
from tests.helpers import drain_heartbeat
from tests.services import RedisBackend
from workers.drain import DrainContext, run_drain

NO_WORKER = "not ready: workers no worker is running: start `rollout-broker worker`"


async def test_ready_with_redis_and_a_migrated_database(
    api: httpx.AsyncClient, redis: Redis, prefix: str
) -> None:
    await drain_heartbeat(redis, prefix)
    assert (await api.get("/healthz")).json() == {"status": "ok"}
    resp = await api.get("/readyz")
    assert resp.status_code == 200
    assert resp.json() == {
        "status": "ready",
        "checks": {"redis": "ok", "postgres": "ok", "migrations": "ok", "workers": "ok"},
    }


def _not_ready(resp: httpx.Response) -> str:
    assert resp.status_code == 503, resp.text
    body = resp.json()
    assert set(body) == {"error", "detail"}
    assert body["error"] == "Unavailable"
    return str(body["detail"])


async def test_ready_only_while_a_drain_runs_and_not_after_it_left(
    api: httpx.AsyncClient,
    redis: Redis,
    prefix: str,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """No worker ever ran on this prefix: 503. The real drain loop runs: 200 once its first
    pass is done (it sent a heartbeat before). It stops cleanly, removing its heartbeat: 503."""
    assert _not_ready(await api.get("/readyz")) == NO_WORKER

    ctx = DrainContext.create(redis, sessionmaker, prefix, DrainOptions(block_ms=10))
    stop, passed = asyncio.Event(), asyncio.Event()
    draining = asyncio.create_task(run_drain(ctx, stop, passed.set))
    try:
        await asyncio.wait_for(passed.wait(), 30)
        resp = await api.get("/readyz")
        assert resp.status_code == 200, resp.text
        assert resp.json()["checks"]["workers"] == "ok"
    finally:
        stop.set()
        await draining
    assert _not_ready(await api.get("/readyz")) == NO_WORKER


async def test_not_ready_when_the_newest_heartbeat_is_over_a_minute_old(
    api: httpx.AsyncClient, redis: Redis, prefix: str
) -> None:
    """A worker that died without leaving keeps its last heartbeat: aged past the window (by
    Redis's clock, as heartbeats are scored), it no longer counts; a new heartbeat does."""
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000
    died = now_ms - ALIVE_WITHIN_S * 1000 - 1000
    await redis.zadd(keys.drain_consumers_key(prefix), {"died-61s-ago": died})
    assert _not_ready(await api.get("/readyz")) == (
        "not ready: workers no worker has drained the accounting within 60 s"
    )
    await drain_heartbeat(redis, prefix)
    assert (await api.get("/readyz")).status_code == 200


async def test_not_ready_until_the_database_is_at_head(
    database_factory: Callable[[], Awaitable[str]], redis_backend: RedisBackend, prefix: str
) -> None:
    url = await database_factory()  # reachable, but no schema yet
    settings = Settings(
        redis_url=redis_backend.url,
        redis_cluster=redis_backend.cluster,
        database_url=url,
        redis_prefix=prefix,
    )
    app = create_app(settings)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as c,
    ):
        await drain_heartbeat(app.state.redis, prefix)  # a worker runs: only migrations lack
        assert (await c.get("/healthz")).status_code == 200  # alive all the same
        assert _not_ready(await c.get("/readyz")) == (
            "not ready: migrations not at head: run migrate"
        )

        await upgrade_to_head(url)
        assert (await c.get("/readyz")).status_code == 200


def test_a_running_drain_beats_within_the_window_whatever_its_timeout() -> None:
    """Heartbeats go out every quarter of the timeout (0.75 s by default), and at least four
    times a minute even with the longest timeout the settings take."""
    assert DrainOptions.from_settings(Settings()).beat_s == 0.75
    for timeout_ms in (100, 240_000, 600_000):
        options = DrainOptions.from_settings(Settings(drain_heartbeat_timeout_ms=timeout_ms))
        assert 0 < options.beat_s <= ALIVE_WITHIN_S / 4, timeout_ms
