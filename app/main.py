"""The FastAPI application: ``create_app()`` wires settings, Redis, the broker and the routers.

Connections are built in the lifespan (by ``app.wiring``), never at import, so tests and the CLI
choose the settings first. The API does not know the background workers: whoever runs them in
the same process (``rollout-broker serve --with-workers``) hands them in as ``background``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import __version__, allocator
from app.access.guard import guard
from app.access.tokens import TokenCache
from app.accounting.db import create_sessionmaker, schema_at_head
from app.api import accounting, batches, health, metrics, prompts, rollouts, runs, tokens, ui
from app.api.codec import describe_errors, render
from app.api.openapi import install_openapi
from app.broker import keys
from app.errors import OUTAGE_CANDIDATES, BrokerError, Unavailable, outage_of
from app.metrics import ProcessMetrics, RequestMetrics
from app.settings import Settings
from app.wiring import broker_for, database_engine, redis_client

log = logging.getLogger("rollout_broker")

Background = Callable[[Settings, asyncio.Event], Coroutine[Any, Any, None]]
"""Work run beside the API for the app's lifetime, until the event is set (the workers)."""

_HTTP_NAMES = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    413: "PayloadTooLarge",
    415: "UnsupportedMediaType",
    422: "ValidationFailed",
    429: "OverCapacity",
}


def error_body(
    name: str, detail: str, status: int, headers: dict[str, str] | None = None
) -> Response:
    resp = render({"error": name, "detail": detail}, status_code=status)
    resp.headers.update(headers or {})
    return resp


class OutageLog:
    """Logs an outage without flooding the log: one warning per store every ``every_s``
    seconds while it lasts, with the number of requests answered ``503`` since the last one."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._answered: dict[str, int] = {}

    def note(self, store: str, exc: BaseException) -> None:
        now = time.monotonic()
        self._answered[store] = self._answered.get(store, 0) + 1
        if now - self._last.get(store, -math.inf) < self.every_s:
            return
        log.warning(
            "%s unreachable (%s: %s): %d requests answered 503 Unavailable",
            store,
            type(exc).__name__,
            exc,
            self._answered[store],
        )
        self._last[store] = now
        self._answered[store] = 0


def install_error_handlers(app: FastAPI) -> None:
    """One renderer for every error: ``{"error": Name, "detail": text}``. A request that fails
    because Redis or Postgres cannot be reached is ``503 Unavailable`` with ``Retry-After``
    (the exceptions of :data:`app.errors.OUTAGE_CANDIDATES` that :func:`app.errors.outage_of`
    names an outage); it is answered here, so the server keeps the connection open."""
    outages = OutageLog()

    @app.exception_handler(BrokerError)
    async def _broker_error(_: Request, exc: BrokerError) -> Response:
        return error_body(exc.name, exc.detail, exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return error_body("ValidationFailed", describe_errors(list(exc.errors())), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        name = _HTTP_NAMES.get(exc.status_code, "HTTPError")
        return error_body(name, str(exc.detail), exc.status_code, dict(exc.headers or {}))

    async def _outage(request: Request, exc: Exception) -> Response:
        store = outage_of(exc)
        if store is None:
            return _internal(exc)
        outages.note(store, exc)
        retry_after_s: int = request.app.state.settings.retry_after_s
        err = Unavailable(
            f"{store} is unreachable ({type(exc).__name__}); try again in {retry_after_s} s",
            retry_after_s=retry_after_s,
        )
        return error_body(err.name, err.detail, err.status, err.headers)

    for cls in OUTAGE_CANDIDATES:
        app.add_exception_handler(cls, _outage)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        return _internal(exc)


def _internal(exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return error_body("InternalError", f"internal error ({type(exc).__name__})", 500)


async def database_checks(engine: AsyncEngine) -> dict[str, str]:
    """Readiness of the accounting database: reachable, and migrated to the latest schema."""
    try:
        at_head = await schema_at_head(engine)
    except Exception as exc:  # readiness reports the failure instead of raising it
        return {"postgres": f"unreachable: {type(exc).__name__}"}
    return {"postgres": "ok", "migrations": "ok" if at_head else "not at head: run migrate"}


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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = redis_client(settings)
        broker = broker_for(redis, settings)
        await broker.waker.start()
        app.state.settings = settings
        app.state.redis = redis
        app.state.broker = broker
        engine = database_engine(settings)
        if engine is not None:
            app.state.db_engine = engine
            app.state.db_sessionmaker = create_sessionmaker(engine)
            app.state.readiness_probe = lambda: database_checks(engine)
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

    app = FastAPI(
        title="Rollout Broker",
        version=__version__,
        summary="Versioned rollouts in, leased batches out, exact sample accounting.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(guard)],
    )
    app.state.settings = settings
    app.state.tokens = None  # auth off; the lifespan sets it when auth is on
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(health.router)
    app.include_router(runs.router)
    app.include_router(rollouts.router)
    app.include_router(batches.router)
    app.include_router(prompts.router)
    app.include_router(accounting.router)
    app.include_router(tokens.router)
    app.include_router(ui.router)
    if settings.metrics:
        # This process's request metrics, in a registry of the app's own (GET /metrics).
        app.include_router(metrics.router)
        app.state.metrics = ProcessMetrics()
        app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    return app
