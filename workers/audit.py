"""The audit loop: moves the audit stream's entries into Postgres (``app.access.audit.flush``)
every ``interval`` seconds, run by ``workers.runner.run_workers`` beside the drain. Several
processes may run it at once: each entry is inserted once. Reading the audit log does not
wait for it (``app.access.audit.entries`` reads the stream too)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.access import audit

__all__ = ["run_audit"]

log = logging.getLogger(__name__)


async def run_audit(
    redis: Redis,
    stream: str,
    sessionmaker: async_sessionmaker[AsyncSession],
    interval: float,
    stop: asyncio.Event,
    done: Callable[[], None] = lambda: None,
) -> None:
    """Move entries until ``stop`` is set; ``done`` is called after each pass that succeeded.
    Redis or Postgres outages are waited out: an entry leaves the stream only once it is in
    Postgres."""
    while not stop.is_set():
        try:
            await audit.flush(redis, stream, sessionmaker)
            done()
        except Exception:  # keep moving: a blip must not end the loop
            log.warning("moving the audit log into Postgres failed", exc_info=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
