"""Whether a process serves with auth on, decided once at start-up from ``BROKER_AUTH`` and the
address it listens on (SPEC "Access control")."""

from __future__ import annotations

import ipaddress

from app.settings import Settings


class AuthSetupError(Exception):
    """The process must not start as configured; the message says what to set."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def resolve_auth(settings: Settings, host: str) -> Settings:
    """``settings`` with ``auth`` decided for a listener on ``host``: as set, or else on for a
    non-loopback address. Refuses (:class:`AuthSetupError`) auth on with no way to sign in."""
    auth = settings.auth if settings.auth is not None else not is_loopback(host)
    if auth and settings.admin_token is None and not settings.embedded:
        # Tokens may exist in Postgres already; the guard checks them per request. A fresh
        # deployment without BROKER_ADMIN_TOKEN could never create the first one.
        pass
    if auth and settings.admin_token is None and settings.embedded:
        raise AuthSetupError(
            f"auth is on ({'BROKER_AUTH=on' if settings.auth else f'the API listens on {host}'})"
            " but nobody could sign in: set BROKER_ADMIN_TOKEN to a secret of at least 32 "
            "characters (then create tokens with `rollout-broker tokens create`), or set "
            "BROKER_AUTH=off to serve without access control"
        )
    return settings.model_copy(update={"auth": auth})
