"""Direct routes: the endpoints whose own work costs less than the router's matching and
dependency solving (a one-rollout ingest) are served past them, with what the router would give."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.dependencies.utils import request_params_to_args
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api._params import query_rules

Guard = Callable[[Request], Awaitable[None]]


class DirectRoutes:
    """ASGI layer in front of the router, inside the app's error handling: a request for one of
    the given endpoints goes straight to it, with what the router and FastAPI would give it (the
    scope's route, endpoint and path parameters, validated by their declared types after the
    guard, as FastAPI does) but without their route matching and dependency solving, which cost
    more than a small ingest's own work.
    Every other request goes to the router, and so does every request while dependency
    overrides are set or while FastAPI's OpenTelemetry instrumentation records it.

    Only an endpoint whose parameters are its path's (strings, ``[^/]+``) and the ``Request``, and
    whose one dependency is the guard, is served so: any other is refused at start. Its route
    must be the one the router picks for its method and path (no earlier route of the app takes
    them); tests/api/test_direct_routes.py checks that both ways answer alike.
    """

    def __init__(
        self,
        app: ASGIApp,
        fastapi_app: FastAPI,
        endpoints: Sequence[Callable[..., Any]],
        guard: Guard,
    ) -> None:
        self.app = app
        self.guard = guard
        self.router = fastapi_app.router
        self.overrides = fastapi_app.dependency_overrides
        self.by_method: dict[str, list[tuple[APIRoute, Any]]] = {}
        for endpoint in endpoints:
            found = [
                context
                for context in iter_route_contexts(fastapi_app.router.routes)
                if getattr(context, "endpoint", None) is endpoint
            ]
            if len(found) != 1 or not isinstance(found[0].original_route, APIRoute):
                raise ValueError(f"{endpoint!r} is not the endpoint of one route")
            route = found[0].original_route
            _check_direct(route, found[0].dependant, guard)
            _check_alone(route, fastapi_app)
            for method in route.methods or ():
                self.by_method.setdefault(method, []).append((route, found[0].dependant))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # FastAPI's own telemetry, when it records this request, names the route it takes.
        if scope["type"] == "http" and not self.overrides and not scope.get("fastapi.telemetry"):
            routes = self.by_method.get(scope["method"])
            if routes:
                path = route_path(scope)
                for route, dependant in routes:
                    match = route.path_regex.match(path)
                    if match is not None:
                        await self._serve(scope, receive, send, route, dependant, match.groupdict())
                        return
        await self.app(scope, receive, send)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: APIRoute,
        dependant: Any,
        found: dict[str, str],
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
        await self.guard(request)
        values, errors = request_params_to_args(dependant.path_params, params)
        if errors:
            raise RequestValidationError(errors)
        response: Response = await route.endpoint(request=request, **values)
        await response(scope, receive, send)


def route_path(scope: Scope) -> str:
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


def _check_direct(route: APIRoute, dependant: Any, guard: Guard) -> None:
    """Refuse a route that :class:`DirectRoutes` would not serve as FastAPI serves it."""
    name = route.endpoint.__name__
    # The query rules have nothing to check in a route without query parameters.
    if [d.call for d in dependant.dependencies if d.call is not query_rules] != [guard]:
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
