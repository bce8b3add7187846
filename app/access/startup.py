"""Whether a process serves with auth on, decided once at start-up from ``BROKER_AUTH`` and the
address it listens on (SPEC "Access control")."""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from app.access.guard import served_name
from app.settings import Settings

log = logging.getLogger("rollout_broker")


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
    non-loopback address. With auth on, somebody must be able to sign in: refuses
    (:class:`AuthSetupError`) when there is neither ``BROKER_ADMIN_TOKEN`` nor an admin token
    in the database, and says how to turn auth on or off."""
    auth = settings.auth if settings.auth is not None else not is_loopback(host)
    if auth and settings.admin_token is None and not _admin_token_stored(settings):
        why = "BROKER_AUTH=on" if settings.auth else f"the API listens on {host}, not loopback"
        raise AuthSetupError(
            f"auth is on ({why}) but nobody could sign in: set BROKER_ADMIN_TOKEN to a secret "
            "of at least 32 characters (e.g. `export BROKER_ADMIN_TOKEN=$(openssl rand -hex "
            "32)`), then create tokens with `rollout-broker tokens create`; or set "
            "BROKER_AUTH=off to serve without access control"
        )
    return settings.model_copy(update={"auth": auth})


def served_on(settings: Settings, host: str) -> Settings:
    """``settings`` with the name the API listens on (``serve --host``) among the host names
    requests may be addressed to while auth is off (``allowed_hosts``), unless it is one
    already (an address or ``localhost``)."""
    name = host.strip("[]").lower().removesuffix(".")
    if served_name(name, settings.allowed_hosts):
        return settings
    return settings.model_copy(update={"allowed_hosts": (*settings.allowed_hosts, name)})


def _admin_token_stored(settings: Settings) -> bool:
    """True when the database holds a live admin token, or cannot say (it is unreachable now:
    the broker answers 503 until it is back, as for any outage)."""
    if settings.database_url is None:
        return False
    return asyncio.run(_admin_token_in(settings.database_url))


async def _admin_token_in(database_url: str) -> bool:
    from sqlalchemy import select
    from sqlalchemy.exc import ProgrammingError, SQLAlchemyError

    from app.access.models import ApiToken
    from app.db import create_engine

    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            found = await conn.scalar(
                select(ApiToken.token_id)
                .where(ApiToken.scopes.contains(["admin"]), ApiToken.revoked_at.is_(None))
                .limit(1)
            )
        return found is not None
    except ProgrammingError:  # not migrated yet: no token table, so no token
        return False
    except (OSError, SQLAlchemyError) as exc:
        log.warning("could not look for admin tokens (%s); starting anyway", type(exc).__name__)
        return True
    finally:
        await engine.dispose()
