"""One renderer for every error: ``{"error": Name, "detail": text}`` with the error's status, for
the broker's own errors, the router's, validation failures, outages (503 with ``Retry-After``)
and anything unexpected (500, logged)."""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from app.api._codec import describe_errors, render
from app.api._direct import route_path
from app.errors import (
    OUTAGE_CANDIDATES,
    BrokerError,
    Unavailable,
    outage_of,
    status_name,
    write_refusal_of,
)

log = logging.getLogger("rollout_broker")


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


class PathMethods:
    """Every method a path is served with, over all of an app's routes: what a ``405`` answer's
    ``Allow`` lists. Starlette names only the methods of the first route whose path matched
    (``OPTIONS /v1/runs`` was answered ``Allow: POST``, without ``GET``)."""

    def __init__(self, routes: list[Any]) -> None:
        self.routes = routes  # the app's list: routes included later are in it too
        self._regexes: dict[str, re.Pattern[str]] = {}

    def of(self, path: str) -> list[str]:
        found: set[str] = set()
        for route in iter_route_contexts(self.routes):  # included routers' routes too
            template, methods = route.path, route.methods
            if template is None or not methods:
                continue
            regex = self._regexes.get(template)
            if regex is None:
                regex = self._regexes[template] = compile_path(template)[0]
            if regex.match(path):
                found |= methods
        return sorted(found)


def install_error_handlers(app: FastAPI) -> None:
    """One renderer for every error: ``{"error": Name, "detail": text}``. A request that fails
    because Redis or Postgres cannot be reached, or Redis refuses writes for now (NOREPLICAS,
    READONLY, ...), is ``503 Unavailable`` with ``Retry-After``
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
        name = status_name(exc.status_code)
        headers = dict(exc.headers or {})
        if exc.status_code == 405 and (allowed := methods.of(route_path(request.scope))):
            headers["Allow"] = ", ".join(allowed)  # every method of the path, not one route's
        return error_body(name, str(exc.detail), exc.status_code, headers)

    async def _outage(request: Request, exc: Exception) -> Response:
        store = outage_of(exc)
        if store is None:
            return _internal(exc)
        outages.note(store, exc)
        retry_after_s: int = request.app.state.settings.retry_after_s
        refused = write_refusal_of(exc)
        what = (
            f"{store} refuses writes for now ({refused})"
            if refused is not None
            else f"{store} is unreachable ({type(exc).__name__})"
        )
        err = Unavailable(f"{what}; try again in {retry_after_s} s", retry_after_s=retry_after_s)
        return error_body(err.name, err.detail, err.status, err.headers)

    for cls in OUTAGE_CANDIDATES:
        app.add_exception_handler(cls, _outage)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        return _internal(exc)


def _internal(exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return error_body("InternalError", f"internal error ({type(exc).__name__})", 500)
