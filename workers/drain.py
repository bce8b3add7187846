"""The accounting drain worker: a thin loop around ``app.accounting.drain.Drainer``, run by
``workers.runner.run_workers`` (``rollout-broker worker``, or ``serve --with-workers``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.access import audit
from app.accounting.drain import DrainCounts, Drainer, DrainOptions

__all__ = ["DrainContext", "drain_once", "run_drain"]

log = logging.getLogger("workers.drain")

_MAX_BACKOFF_S = 5.0
_LEAVE_TIMEOUT_S = 5.0


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

    async def flush_audit(self) -> int:
        """Move the audit log's entries from Redis into Postgres (app/access/audit.py)."""
        stream = self.drainer.stream
        return await audit.flush(
            stream.redis, keys.audit_key(stream.prefix), self.drainer.sessionmaker
        )


async def drain_once(
    ctx: DrainContext, *, block_ms: int | None = None, claim: bool | None = None
) -> DrainCounts:
    """Drain what is available now (waiting up to ``block_ms`` for new entries if idle)."""
    return await ctx.drainer.drain_once(block_ms=block_ms, claim=claim)


async def _pause(stop_event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop_event.wait(), timeout=seconds)


async def _beat(ctx: DrainContext, stop_event: asyncio.Event) -> None:
    """Heartbeats on their own schedule, so a long pass (a slow commit, a big backlog) does
    not make this consumer look dead to the others."""
    while not stop_event.is_set():
        try:
            await ctx.drainer.beat()
        except Exception:  # Redis is down: the pass's own retries report it
            log.debug("drain heartbeat failed", exc_info=True)
        await _pause(stop_event, ctx.options.beat_s)


async def run_drain(
    ctx: DrainContext, stop_event: asyncio.Event, done: Callable[[], None] = lambda: None
) -> None:
    """Drain until ``stop_event`` is set; Redis or Postgres outages are waited out. ``done``
    is called after each pass that succeeded. On the way out the consumer leaves the groups
    where it holds nothing, so a clean restart adds no consumer."""
    heartbeat = asyncio.create_task(_beat(ctx, stop_event))
    try:
        backoff = 0.0
        while not stop_event.is_set():
            try:
                counts = await drain_once(ctx, block_ms=ctx.options.block_ms)
                await ctx.flush_audit()
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
    finally:
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat
        try:
            await asyncio.wait_for(ctx.drainer.leave(), timeout=_LEAVE_TIMEOUT_S)
        except Exception:  # its entries are taken over once its heartbeat is missed
            log.warning("drain consumer could not leave cleanly", exc_info=True)


if __name__ == "__main__":  # the entry point this module used to be
    raise SystemExit("`python -m workers.drain` is gone: run `rollout-broker worker`")
