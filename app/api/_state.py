"""What every domain's endpoints take from the request and the application state built in the
lifespan: the settings, the database session, the caller the guard let through, the action log."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated

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


log = logging.getLogger(__name__)


async def move_actions(request: Request, run_id: str) -> bool:
    """Move the run's outbox, where the action just made wrote its entry with the change, into
    the audit log; False when that failed (a warning) or there is no database to move it into.
    Either way the action stands and its entry is safe in the outbox: the audit worker loop
    moves it later."""
    actions: ActionLog | None = getattr(request.app.state, "action_log", None)
    if actions is None:
        return False
    try:
        await actions.moved(run_id)
    except Exception:  # the action is made: its answer is its success
        log.warning(
            "moving the audit entries of run %r failed: the audit loop moves them later",
            run_id,
            exc_info=True,
        )
        return False
    return True
