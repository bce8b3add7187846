"""What every domain's endpoints take from the request and the application state built in the
lifespan: the settings, the database session, the caller the guard let through, the action log."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.caller import ActionLog, Caller
from app.errors import Unavailable
from app.settings import Settings


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


def caller_of(request: Request) -> Caller:
    """The caller the guard let through (it runs before every endpoint that is not public)."""
    caller: Caller | None = getattr(request.state, "caller", None)
    if caller is None:
        raise RuntimeError(f"{request.url.path}: no caller: the guard did not run")
    return caller


async def record_action(
    request: Request, action: str, run_id: str | None, detail: Mapping[str, Any]
) -> None:
    """Write an operator action on run state to the audit log, as the request's caller."""
    log: ActionLog = request.app.state.action_log
    await log.record(caller_of(request), action, run_id, detail)
