"""The FastAPI application: ``create_app()`` wires settings, Redis, the broker and the routers.

Connections are built in the lifespan (by ``app.wiring``), never at import, so tests and the CLI
choose the settings first. The API does not know the background workers: whoever runs them in
the same process (``rollout-broker serve --with-workers``) hands them in as ``background``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute, iter_route_contexts
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from app import __version__, allocator, keys
from app.access.guard import guard
from app.access.tokens import TokenCache
from app.api import accounting, batches, health, metrics, prompts, rollouts, runs, tokens, ui
from app.api.codec import describe_errors, render
from app.api.openapi import PathMethods, install_openapi
from app.db import create_sessionmaker, schema_at_head
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
    names an outage); it is answered here, so the server keeps the connection open. A ``405``
    lists every method of its path in ``Allow``."""
    outages = OutageLog()

    @app.exception_handler(BrokerError)
    async def _broker_error(_: Request, exc: BrokerError) -> Response:
        return error_body(exc.name, exc.detail, exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return error_body("ValidationFailed", describe_errors(list(exc.errors())), 422)

    methods = PathMethods(app.router.routes)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        name = _HTTP_NAMES.get(exc.status_code, "HTTPError")
        headers = dict(exc.headers or {})
        if exc.status_code == 405 and (allowed := methods.of(_route_path(request.scope))):
            headers["Allow"] = ", ".join(allowed)  # every method of the path, not one route's
        return error_body(name, str(exc.detail), exc.status_code, headers)

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


class DirectRoutes:
    """ASGI layer in front of the router, inside the app's error handling: a request for one of
    the given endpoints goes straight to it, with what the router and FastAPI would give it (the
    scope's route, endpoint and path parameters; the guard before the endpoint) but without their
    route matching and dependency solving, which cost more than a small ingest's own work.
    Every other request goes to the router, and so does every request while dependency
    overrides are set or while FastAPI's OpenTelemetry instrumentation records it.

    Only an endpoint whose parameters are its path's (plain strings) and the ``Request``, and
    whose one dependency is the guard, is served so: any other is refused at start. Its route
    must be the one the router picks for its method and path (no earlier route of the app takes
    them); tests/api/test_direct_routes.py checks that both ways answer alike.
    """

    def __init__(
        self, app: ASGIApp, fastapi_app: FastAPI, endpoints: Sequence[Callable[..., Any]]
    ) -> None:
        self.app = app
        self.router = fastapi_app.router
        self.overrides = fastapi_app.dependency_overrides
        self.by_method: dict[str, list[APIRoute]] = {}
        for endpoint in endpoints:
            found = [
                context
                for context in iter_route_contexts(fastapi_app.router.routes)
                if getattr(context, "endpoint", None) is endpoint
            ]
            if len(found) != 1 or not isinstance(found[0].original_route, APIRoute):
                raise ValueError(f"{endpoint!r} is not the endpoint of one route")
            route = found[0].original_route
            _check_direct(route, found[0].dependant)
            _check_alone(route, fastapi_app)
            for method in route.methods or ():
                self.by_method.setdefault(method, []).append(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # FastAPI's own telemetry, when it records this request, names the route it takes.
        if scope["type"] == "http" and not self.overrides and not scope.get("fastapi.telemetry"):
            routes = self.by_method.get(scope["method"])
            if routes:
                path = _route_path(scope)
                for route in routes:
                    match = route.path_regex.match(path)
                    if match is not None:
                        await self._serve(scope, receive, send, route, match.groupdict())
                        return
        await self.app(scope, receive, send)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, route: APIRoute, found: dict[str, str]
    ) -> None:
        params: dict[str, Any] = dict(scope.get("path_params", {}))
        for key, value in found.items():
            params[key] = route.param_convertors[key].convert(value)
        if "router" not in scope:
            scope["router"] = self.router
        scope["endpoint"] = route.endpoint
        scope["path_params"] = params
        scope["route"] = route
        request = Request(scope, receive, send)
        await guard(request)
        response: Response = await route.endpoint(request=request, **params)
        await response(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path the router matches: the scope's path less its ``root_path``, as Starlette's
    router takes it."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        if path == root:
            return ""
        if path[len(root)] == "/":
            return path[len(root) :]
    return path


def _check_alone(route: APIRoute, fastapi_app: FastAPI) -> None:
    """Refuse a route whose requests another route of the app may also take (a path of the same
    form, with a method of it, or a mount above it): the router might pick that one."""
    probe = route.path_format.format(**{name: "x" for name in route.param_convertors})
    for other in iter_route_contexts(fastapi_app.router.routes):
        if other.original_route is route:
            continue
        path, methods = other.path, other.methods
        if path is None:  # not routed by path
            taken = True
        elif methods is None:  # a mount: every request under its path
            taken = probe == path or probe.startswith(path.rstrip("/") + "/")
        else:
            taken = bool(methods & (route.methods or set())) and bool(
                compile_path(path)[0].match(probe)
            )
        if taken:
            raise ValueError(f"{route.endpoint.__name__}: {path} takes its requests too")


def _check_direct(route: APIRoute, dependant: Any) -> None:
    """Refuse a route that :class:`DirectRoutes` would not serve as FastAPI serves it."""
    name = route.endpoint.__name__
    if [d.call for d in dependant.dependencies] != [guard]:
        raise ValueError(f"{name}: its dependencies are not the guard alone")
    if dependant.query_params or dependant.header_params or dependant.cookie_params:
        raise ValueError(f"{name}: it takes parameters besides its path's")
    if dependant.body_params or dependant.request_param_name != "request":
        raise ValueError(f"{name}: it must take the Request and no body parameter")
    if not inspect.iscoroutinefunction(route.endpoint):
        raise ValueError(f"{name}: it is not a coroutine function")
    for field in dependant.path_params:
        if (
            field.field_info.annotation is not str
            or route.param_convertors[field.name].regex != "[^/]+"
        ):
            raise ValueError(f"{name}: its path parameter {field.name!r} is not a plain string")


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
    app.router.middleware_stack = DirectRoutes(
        app.router.middleware_stack, app, [rollouts.post_rollouts]
    )
    return app
