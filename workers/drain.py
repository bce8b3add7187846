"""The accounting drain worker: a thin loop around ``app.accounting.drain.Drainer``.

``python -m workers.drain`` runs it on its own (reads ``BROKER_*`` and ``BROKER_DRAIN_*``);
``rollout-broker serve`` runs :func:`run_drain` in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting.db import create_sessionmaker, engine_from_settings, schema_at_head
from app.accounting.drain import DrainCounts, Drainer, DrainOptions, DrainSettings
from app.settings import Settings

__all__ = ["DrainContext", "drain_once", "main", "run_drain", "serve"]

log = logging.getLogger("workers.drain")

_MAX_BACKOFF_S = 5.0


@dataclass
class DrainContext:
    drainer: Drainer

    @classmethod
    def create(
        cls,
        redis: Redis,
        sessionmaker: async_sessionmaker[AsyncSession],
        prefix: str,
        options: DrainOptions | None = None,
        consumer: str | None = None,
    ) -> DrainContext:
        return cls(Drainer.create(redis, sessionmaker, prefix, options, consumer))

    @property
    def options(self) -> DrainOptions:
        return self.drainer.options


async def drain_once(
    ctx: DrainContext, *, block_ms: int | None = None, claim: bool | None = None
) -> DrainCounts:
    """Drain what is available now (waiting up to ``block_ms`` for new entries if idle)."""
    return await ctx.drainer.drain_once(block_ms=block_ms, claim=claim)


async def _pause(stop_event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop_event.wait(), timeout=seconds)


async def run_drain(
    ctx: DrainContext, stop_event: asyncio.Event, done: Callable[[], None] = lambda: None
) -> None:
    """Drain until ``stop_event`` is set; Redis or Postgres outages are waited out. ``done``
    is called after each pass that succeeded."""
    backoff = 0.0
    while not stop_event.is_set():
        try:
            counts = await drain_once(ctx, block_ms=ctx.options.block_ms)
        except Exception:
            # Everything read but not acknowledged stays pending and is re-delivered.
            backoff = min(max(backoff * 2, 0.05), _MAX_BACKOFF_S)
            log.warning("drain pass failed; retrying in %.2fs", backoff, exc_info=True)
            await _pause(stop_event, backoff)
            continue
        backoff = 0.0
        done()
        if counts.streams == 0:
            await _pause(stop_event, ctx.options.block_ms / 1000)


async def serve(settings: Settings, drain_settings: DrainSettings) -> int:
    """Run the drain on its own connections until SIGTERM/SIGINT; the process exit code."""
    assert settings.redis_url is not None and settings.database_url is not None
    redis = Redis.from_url(settings.redis_url, decode_responses=False)
    engine = engine_from_settings(settings)
    try:
        if not await schema_at_head(engine):
            log.error("accounting schema is not at head: run `rollout-broker migrate` first")
            return 2
        ctx = DrainContext.create(
            redis,
            create_sessionmaker(engine),
            settings.redis_prefix,
            drain_settings.options(),
            drain_settings.consumer,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        log.info("draining %s:* as consumer %s", settings.redis_prefix, ctx.drainer.consumer)
        await run_drain(ctx, stop)
        return 0
    finally:
        await redis.aclose()
        await engine.dispose()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = Settings()
    if settings.redis_url is None or settings.database_url is None:
        sys.exit("workers.drain needs BROKER_REDIS_URL and BROKER_DATABASE_URL")
    sys.exit(asyncio.run(serve(settings, DrainSettings())))


if __name__ == "__main__":
    main()
