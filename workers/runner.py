"""All background workers of one process, started and stopped together."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from app.broker.notify import Waker
from app.broker.service import Broker
from app.broker.store import RedisStore
from app.settings import Settings
from workers.maintenance import run_maintenance


def broker_for(redis: Redis, settings: Settings) -> Broker:
    store = RedisStore(redis, settings.redis_prefix)
    return Broker(
        store,
        Waker(redis, store.wake_channel, settings.redis_prefix),
        max_tokens_per_rollout=settings.max_tokens_per_rollout,
        max_rollouts_per_request=settings.max_rollouts_per_request,
        max_batch_size=settings.max_batch_size,
        max_wait_s=settings.max_wait_s,
        retry_after_s=settings.retry_after_s,
    )


async def run_workers(settings: Settings, stop: asyncio.Event) -> None:
    assert settings.redis_url is not None
    redis = Redis.from_url(settings.redis_url, decode_responses=False)
    try:
        await run_maintenance(broker_for(redis, settings), settings.sweep_interval_s, stop)
    finally:
        await redis.aclose()
