"""The audit loop: every ``interval`` seconds, moves into Postgres the entries left in the runs'
outboxes (``app.access.audit.move_all``): those whose move right after their action failed (or
whose API process died first), and what an older version left in its stream. Run by
``workers.runner.run_workers`` beside the drain. Several processes may run it at once: each
entry is inserted once."""

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
    prefix: str,
    sessionmaker: async_sessionmaker[AsyncSession],
    interval: float,
    stop: asyncio.Event,
    done: Callable[[], None] = lambda: None,
) -> None:
    """Move entries until ``stop`` is set; ``done`` is called after each pass that succeeded.
    Redis or Postgres outages are waited out: an entry leaves its outbox only once it is in
    Postgres."""
    while not stop.is_set():
        try:
            await audit.move_all(redis, prefix, sessionmaker)
            done()
        except Exception:  # keep moving: a blip must not end the loop
            log.warning("moving the audit log into Postgres failed", exc_info=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
