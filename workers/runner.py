"""All background workers of one process, started and stopped together: the maintenance sweep
(lease expiry, group timeouts, eager retirement) and, with a database, the accounting drain and
the audit loop."""

from __future__ import annotations

import asyncio
import contextlib

from app.accounting.drain import DrainOptions
from app.db import create_sessionmaker
from app.settings import Settings
from app.wiring import (
    RedisTooOldError,
    broker_for,
    check_redis_version,
    database_engine,
    redis_client,
)
from workers.audit import run_audit
from workers.drain import DrainContext, run_drain
from workers.heartbeat import Heartbeat
from workers.maintenance import run_maintenance

__all__ = ["run_workers"]


async def run_workers(settings: Settings, stop: asyncio.Event) -> None:
    """Run every worker until ``stop`` is set, each on connections of its own; raises
    :class:`~app.wiring.RedisTooOldError` at once on a Redis older than 7.0."""
    redis = redis_client(settings)
    try:  # a Redis older than 7.0 ends the workers; one that is down is waited out as any outage
        await check_redis_version(redis, settings)
    except RedisTooOldError:
        await redis.aclose()
        raise
    # The drain blocks on XREADGROUP: a client of its own keeps that off the sweep's pool.
    drain_redis = redis_client(settings)
    engine = database_engine(settings)
    heartbeat = Heartbeat(
        settings.worker_heartbeat_file,
        ["maintenance", "drain", "audit"] if engine else ["maintenance"],
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
        sessionmaker = create_sessionmaker(engine)
        ctx = DrainContext.create(
            drain_redis,
            sessionmaker,
            settings.redis_prefix,
            DrainOptions.from_settings(settings),
            settings.drain_consumer,
        )
        loops.append(run_drain(ctx, stop, lambda: heartbeat.beat("drain")))
        loops.append(
            run_audit(
                redis,
                settings.redis_prefix,
                sessionmaker,
                settings.audit_interval_s,
                stop,
                lambda: heartbeat.beat("audit"),
            )
        )
    try:
        await asyncio.gather(*loops)
    finally:
        for client in (redis, drain_redis):
            with contextlib.suppress(Exception):  # one failing close must not skip the other
                await client.aclose()
        if engine is not None:
            await engine.dispose()
