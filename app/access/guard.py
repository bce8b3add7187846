"""The request guard: one dependency of every route that applies :mod:`app.access.policy` to
the caller named by the request's bearer token, or, with auth off, refuses state-changing
requests from a foreign web page (their ``Origin``)."""

from __future__ import annotations

from typing import Final
from urllib.parse import SplitResult, urlsplit

from fastapi import Request

from app.access.policy import ANONYMOUS, PUBLIC, has, need_of
from app.access.tokens import TokenCache
from app.caller import check_run
from app.errors import Forbidden, Unauthorized

SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


async def guard(request: Request) -> None:
    """Let the request through, with ``request.state.caller`` set, or refuse it (401/403)."""
    route = request.scope.get("route")
    path: str = route.path if route is not None else request.url.path
    need = need_of(request.method, path)
    if need is None:
        raise Forbidden(f"{request.method} {path} is not in the access table")
    if need == PUBLIC:
        return
    tokens: TokenCache | None = getattr(request.app.state, "tokens", None)
    if tokens is None:  # auth off
        if request.method not in SAFE_METHODS and foreign_origin(request):
            raise Forbidden(
                "a state-changing request from another web origin "
                f"({request.headers['origin']!r}) is refused while auth is off"
            )
        request.state.caller = ANONYMOUS
        return
    caller = await tokens.caller(bearer(request))
    if caller is None:
        raise Unauthorized("unknown or revoked token")
    if not has(caller, need):
        raise Forbidden(f"token {caller.name!r} lacks the scope {str(need)!r}")
    run_id = request.path_params.get("run_id")
    if run_id is not None:
        check_run(caller, run_id)
    request.state.caller = caller


def bearer(request: Request) -> str:
    value = request.headers.get("authorization")
    if value is None:
        raise Unauthorized("this broker requires a token: send 'Authorization: Bearer <token>'")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("the Authorization header must read 'Bearer <token>'")
    return token.strip()


def foreign_origin(request: Request) -> bool:
    """True when the request names an ``Origin`` that is not the broker's own address (the
    ``Host`` it was sent to). A browser sends ``Origin`` with every cross-site POST; clients
    outside browsers send none."""
    origin = request.headers.get("origin")
    if origin is None:
        return False
    try:
        theirs = urlsplit(origin)
        if not theirs.hostname:
            return True  # "null" (a sandboxed or file: page), or unreadable
        return _address(theirs) != _address(
            urlsplit("//" + request.headers.get("host", ""), scheme=request.url.scheme)
        )
    except ValueError:  # a port that is no number: not ours
        return True


def _address(url: SplitResult) -> tuple[str, int | None]:
    return (url.hostname or "").lower(), url.port or _DEFAULT_PORTS.get(url.scheme)
