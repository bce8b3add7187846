"""All background workers of one process, started and stopped together: the maintenance sweep
(lease expiry, group timeouts, eager retirement) and, with a database, the accounting drain."""

from __future__ import annotations

import asyncio
import contextlib

from redis.asyncio import Redis

from app.accounting.db import create_sessionmaker, engine_from_settings
from app.accounting.drain import DrainSettings
from app.broker.notify import Waker
from app.broker.service import Broker
from app.broker.store import RedisStore
from app.settings import Settings
from workers.drain import DrainContext, run_drain
from workers.heartbeat import Heartbeat
from workers.maintenance import run_maintenance


def broker_for(redis: Redis, settings: Settings) -> Broker:
    store = RedisStore(redis, settings.redis_prefix)
    return Broker(
        store,
        Waker(redis, store.wake_channel, settings.redis_prefix, settings.wake_fallback_s),
        max_tokens_per_rollout=settings.max_tokens_per_rollout,
        max_rollouts_per_request=settings.max_rollouts_per_request,
        max_batch_size=settings.max_batch_size,
        max_wait_s=settings.max_wait_s,
        retry_after_s=settings.retry_after_s,
        behaviour_cache_bytes=settings.behaviour_cache_bytes,
    )


async def run_workers(settings: Settings, stop: asyncio.Event) -> None:
    """Run every worker until ``stop`` is set, each on connections of its own."""
    assert settings.redis_url is not None
    redis = Redis.from_url(settings.redis_url, decode_responses=False)
    # The drain blocks on XREADGROUP: a client of its own keeps that off the sweep's pool.
    drain_redis = Redis.from_url(settings.redis_url, decode_responses=False)
    engine = engine_from_settings(settings) if settings.database_url else None
    heartbeat = Heartbeat(
        settings.worker_heartbeat_file, ["maintenance", "drain"] if engine else ["maintenance"]
    )
    loops = [
        run_maintenance(
            broker_for(redis, settings),
            settings.sweep_interval_s,
            stop,
            lambda: heartbeat.beat("maintenance"),
        )
    ]
    if engine is not None:
        drain_settings = DrainSettings()
        ctx = DrainContext.create(
            drain_redis,
            create_sessionmaker(engine),
            settings.redis_prefix,
            drain_settings.options(),
            drain_settings.consumer,
        )
        loops.append(run_drain(ctx, stop, lambda: heartbeat.beat("drain")))
    try:
        await asyncio.gather(*loops)
    finally:
        for client in (redis, drain_redis):
            with contextlib.suppress(Exception):  # one failing close must not skip the other
                await client.aclose()
        if engine is not None:
            await engine.dispose()
