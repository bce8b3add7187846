"""The request guard: one dependency of every route that applies :mod:`app.access.policy` to
the caller named by the request's bearer token, or, with auth off, refuses what a foreign web
page may send: a state-changing request from another origin (its ``Origin`` or
``Sec-Fetch-Site``), and any request addressed to a host name the broker does not serve (its
``Host``, which DNS rebinding makes the page's own)."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Collection
from typing import Final
from urllib.parse import SplitResult, urlsplit

from fastapi import Request

from app.access.policy import ANONYMOUS, PUBLIC, has, rule_of
from app.access.tokens import TokenCache
from app.caller import check_run
from app.errors import Forbidden, Unauthorized

_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_OTHER_SITES: Final = frozenset({"cross-site", "same-site"})
"""``Sec-Fetch-Site`` values of a request a page of another origin made (``same-site`` is
another port or subdomain); ``same-origin`` and ``none`` (the user's own navigation) are not."""


async def guard(request: Request) -> None:
    """Let the request through, with ``request.state.caller`` set, or refuse it (401/403)."""
    route = request.scope.get("route")
    # The template without its converters ('{generator_id:path}' reads '{generator_id}').
    path: str = route.path_format if route is not None else request.url.path
    rule = rule_of(request.method, path)
    if rule is None:
        raise Forbidden(f"{request.method} {path} is not in the access table")
    need = rule.need
    if need == PUBLIC:
        return
    tokens: TokenCache | None = getattr(request.app.state, "tokens", None)
    if tokens is None:  # auth off
        if rule.needs_auth:
            raise Forbidden(
                "auth is off, so tokens cannot be created: one made now would belong to nobody "
                "and become valid when auth is turned on; turn auth on (BROKER_AUTH=on, with "
                "BROKER_ADMIN_TOKEN) and create tokens with an admin token"
            )
        refuse_web_pages(request, rule.changes_state)
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


def refuse_web_pages(request: Request, changes_state: bool) -> None:
    """With auth off, the Origin rule (SPEC "Access control"): a request addressed to a host
    name the broker does not serve is refused, and so is a state-changing one from a page of
    another origin (403)."""
    host = request.headers.get("host")
    if host is not None and not served_host(host, request.app.state.settings.allowed_hosts):
        raise Forbidden(
            f"Host {host!r} is not a name this broker serves while auth is off: address it as "
            "localhost, by IP address or by a name of BROKER_ALLOWED_HOSTS"
        )
    if not changes_state:
        return
    site = request.headers.get("sec-fetch-site", "").lower()
    if site in _OTHER_SITES:
        raise Forbidden(
            "a state-changing request from another web origin (Sec-Fetch-Site: "
            f"{site}) is refused while auth is off"
        )
    if foreign_origin(request):
        raise Forbidden(
            "a state-changing request from another web origin "
            f"({request.headers['origin']!r}) is refused while auth is off"
        )


@functools.lru_cache(maxsize=1024)
def served_host(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a ``Host`` header (a name or address, and a port) names this broker (see
    :func:`served_name`). Kept for the last 1,024 (header, names) asked: with auth off every
    request asks, nearly always with the same header, and parsing it cost a one-rollout ingest
    about 4 % of its CPU."""
    if "@" in host:
        return False
    try:
        url = urlsplit("//" + host)
        name, _ = url.hostname, url.port
    except ValueError:  # a port that is no number, or a broken IPv6 address
        return False
    return name is not None and served_name(name, allowed)


def served_name(name: str, allowed: Collection[str]) -> bool:
    """Whether the host ``name`` is one the broker serves: ``localhost``, an IP address (an
    address, unlike a name, cannot be pointed elsewhere by a web page's owner), or a name of
    ``allowed`` (lower case, without a final dot)."""
    name = name.lower().removesuffix(".")
    if name == "localhost" or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


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
