"""The FastAPI application: ``create_app()`` wires settings, Redis, the database, the three
domains (broker, accounting, access) and the transport (:mod:`app.api`); it is the one place that
knows them all.

Connections are built in the lifespan (by ``app.wiring``), never at import, so tests and the CLI
choose the settings first. The API does not know the background workers: whoever runs them in
the same process (``rollout-broker serve --with-workers``) hands them in as ``background``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Depends, FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from app import __version__, allocator, health, keys, metrics, ui
from app.access import endpoints as access_endpoints
from app.access import openapi as access_openapi
from app.access.audit import OutboxLog
from app.access.guard import guard
from app.access.tokens import TokenCache
from app.accounting import endpoints as accounting_endpoints
from app.accounting.consumers import ConsumerGroup, drain_check
from app.api import DirectRoutes, install_error_handlers, install_openapi, query_rules
from app.broker import endpoints as broker_endpoints
from app.broker.endpoints import openapi as broker_openapi
from app.db import create_sessionmaker, schema_at_head
from app.settings import Settings
from app.wiring import (
    RedisTooOldError,
    broker_for,
    check_redis_version,
    database_engine,
    redis_client,
)

Background = Callable[[Settings, asyncio.Event], Coroutine[Any, Any, None]]
"""Work run beside the API for the app's lifetime, until the event is set (the workers)."""


async def database_checks(engine: AsyncEngine) -> dict[str, str]:
    """Readiness of the accounting database: reachable, and migrated to the latest schema."""
    try:
        at_head = await schema_at_head(engine)
    except Exception as exc:  # readiness reports the failure instead of raising it
        return {"postgres": f"unreachable: {type(exc).__name__}"}
    return {"postgres": "ok", "migrations": "ok" if at_head else "not at head: run migrate"}


async def accounting_checks(engine: AsyncEngine, drains: ConsumerGroup) -> dict[str, str]:
    """Readiness of the accounting: its database (:func:`database_checks`), and a background
    worker draining it (``workers``: a drain heartbeat within the last minute)."""
    return {**await database_checks(engine), "workers": await drain_check(drains)}


def create_app(
    settings: Settings | None = None, *, background: Background | None = None
) -> FastAPI:
    """The API app. ``background`` runs for the app's lifetime; it is required when
    ``settings.workers_in_process`` asks for the workers in this process."""
    settings = settings or Settings()
    allocator.keep_freed_pages(settings.keep_freed_bytes)
    if settings.workers_in_process and background is None:
        raise ValueError(
            "workers_in_process is set but no workers were given: run `rollout-broker serve "
            "--with-workers`, or pass background=workers.runner.run_workers"
        )
    app = FastAPI(
        title="Rollout Broker",
        version=__version__,
        summary="Versioned rollouts in, leased batches out, exact sample accounting.",
        lifespan=_lifespan(settings, background),
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(guard), Depends(query_rules)],
    )
    app.state.settings = settings
    app.state.tokens = None  # auth off; the lifespan sets it when auth is on
    install_error_handlers(app)
    install_openapi(app, [broker_openapi.OPENAPI, access_openapi.OPENAPI])
    app.include_router(health.router)
    for router in broker_endpoints.ROUTERS:
        app.include_router(router)
    app.include_router(accounting_endpoints.router)
    app.include_router(access_endpoints.router)
    app.include_router(ui.router)
    if settings.metrics:
        # This process's request metrics, in a registry of the app's own (GET /metrics).
        app.include_router(metrics.router)
        app.state.metrics = metrics.ProcessMetrics()
        app.add_middleware(metrics.RequestMetrics, metrics=app.state.metrics)
    app.router.middleware_stack = DirectRoutes(
        app.router.middleware_stack, app, [broker_endpoints.post_rollouts], guard
    )
    return app


def _lifespan(
    settings: Settings, background: Background | None
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Builds the connections, the broker, the token cache and the action log on start, runs
    ``background`` meanwhile, and closes them all on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = redis_client(settings)
        try:  # a Redis older than 7.0 ends the start; one that is down is asked by /readyz
            app.state.redis_version_known = await check_redis_version(redis, settings)
        except RedisTooOldError:
            await redis.aclose()
            raise
        broker = broker_for(redis, settings)
        await broker.waker.start()
        app.state.settings = settings
        app.state.redis = redis
        app.state.broker = broker
        app.state.action_log = None  # without a database, outboxes wait for one
        engine = database_engine(settings)
        if engine is not None:
            app.state.db_engine = engine
            app.state.db_sessionmaker = create_sessionmaker(engine)
            app.state.action_log = OutboxLog(
                redis, settings.redis_prefix, app.state.db_sessionmaker
            )
            drains = ConsumerGroup(redis, settings.redis_prefix)
            app.state.readiness_probe = lambda: accounting_checks(engine, drains)
        if settings.auth:
            admin = settings.admin_token
            app.state.tokens = TokenCache(
                getattr(app.state, "db_sessionmaker", None),
                redis,
                keys.tokens_channel(settings.redis_prefix),
                settings.token_cache_s,
                bootstrap=admin.get_secret_value() if admin is not None else None,
            )
            await app.state.tokens.start()
        stop = asyncio.Event()
        workers: asyncio.Task[None] | None = None
        if background is not None:
            workers = asyncio.create_task(background(settings, stop), name="broker-workers")
        try:
            yield
        finally:
            stop.set()
            if workers is not None:
                await workers
            await broker.waker.stop()
            if app.state.tokens is not None:
                await app.state.tokens.stop()
            await redis.aclose()
            if engine is not None:
                await engine.dispose()

    return lifespan
