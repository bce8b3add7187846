"""What the routers take from the application state built in the lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.access import audit
from app.access.guard import caller_of
from app.broker.service import Broker
from app.errors import Unavailable
from app.settings import Settings


def broker_of(request: Request) -> Broker:
    broker: Broker = request.app.state.broker
    return broker


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def sessionmaker_of(request: Request) -> async_sessionmaker[AsyncSession]:
    sessionmaker: async_sessionmaker[AsyncSession] | None = getattr(
        request.app.state, "db_sessionmaker", None
    )
    if sessionmaker is None:
        raise Unavailable("this needs the accounting database: set BROKER_DATABASE_URL")
    return sessionmaker


async def _session(request: Request) -> AsyncIterator[AsyncSession]:
    async with sessionmaker_of(request)() as session:
        yield session


Session = Annotated[AsyncSession, Depends(_session)]


async def record_action(
    request: Request, action: str, run_id: str | None, detail: Mapping[str, Any]
) -> None:
    """Write an operator action on run state to the audit log, as the request's caller."""
    await audit.record(
        request.app.state.redis,
        keys.audit_key(settings_of(request).redis_prefix),
        caller_of(request),
        action,
        run_id,
        detail,
    )
