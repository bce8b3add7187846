"""Operator endpoints of the accounting: totals, per-version rows (of the rollouts and of the
trainer), per-generator rows, batch ledger, prompt ledger, dead letters."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request

from app.accounting.schemas import (
    BatchPage,
    DeadLetterPage,
    GeneratorsAccounting,
    PromptPage,
    RunAccounting,
    TrainingAccounting,
    VersionsAccounting,
)
from app.accounting.service import AccountingService
from app.api import Session, errors
from app.ids import RunId

__all__ = ["router"]

router = APIRouter(prefix="/v1/runs/{run_id}", tags=["accounting"])


def _service(request: Request) -> AccountingService:
    return AccountingService.create(
        request.app.state.redis, request.app.state.settings.redis_prefix
    )


Accounting = Annotated[AccountingService, Depends(_service)]
Limit = Annotated[int, Query(ge=1, le=1000)]
# A cursor is what a previous page handed out; any other is refused.
_CURSOR_400 = errors((400, "The cursor is not one this listing handed out"))


@router.get("/accounting", response_model=RunAccounting)
async def get_accounting(run_id: RunId, session: Session, accounting: Accounting) -> RunAccounting:
    """Exact totals of the run, as of the newest drained event."""
    return await accounting.run_accounting(session, run_id)


@router.get("/accounting/versions", response_model=VersionsAccounting)
async def get_version_accounting(
    run_id: RunId, session: Session, accounting: Accounting
) -> VersionsAccounting:
    """The same accounting per policy version of the rollouts."""
    return await accounting.version_accounting(session, run_id)


@router.get("/accounting/training", response_model=TrainingAccounting)
async def get_training_accounting(
    run_id: RunId, session: Session, accounting: Accounting
) -> TrainingAccounting:
    """KL, importance ratio and clip fraction per policy version of the trainer: the acknowledged
    batches grouped by the version V of their lease, not by the rollouts' versions."""
    return await accounting.training_accounting(session, run_id)


@router.get("/accounting/generators", response_model=GeneratorsAccounting)
async def get_generator_accounting(
    run_id: RunId, session: Session, accounting: Accounting
) -> GeneratorsAccounting:
    """Per generator of the run's rollouts: what it generated, the uses of its rollouts, the
    mismatch measured on them, and whether it is quarantined."""
    return await accounting.generator_accounting(session, run_id)


@router.get("/batches", response_model=BatchPage, responses=_CURSOR_400)
async def list_batches(
    run_id: RunId,
    session: Session,
    accounting: Accounting,
    limit: Limit = 100,
    cursor: str | None = None,
) -> BatchPage:
    """The batch ledger in lease order; follow ``next_cursor`` for more."""
    return await accounting.batches(session, run_id, limit=limit, cursor=cursor)


@router.get(
    "/prompts",
    response_model=PromptPage,
    responses=errors(
        (
            422,
            "A parameter is malformed, the cursor is not one this listing handed out, or a "
            "pool is asked of a run without difficulty pools",
        )
    ),
)
async def list_prompts(
    run_id: RunId,
    session: Session,
    accounting: Accounting,
    state: Annotated[
        Literal["queued", "in_flight", "done", "failed", "skipped", "cancelled"] | None,
        Query(description="Only the passes in this state; all when absent"),
    ] = None,
    pool: Annotated[
        Literal["easy", "normal", "hard"] | None,
        Query(
            description="Only the passes of prompts in this difficulty pool, judged from their "
            "newest group mean and the run's current thresholds (a run with difficulty only); "
            "all when absent"
        ),
    ] = None,
    limit: Limit = 100,
    cursor: str | None = None,
) -> PromptPage:
    """The prompt ledger: each prompt pass in its newest state, with its prompt's newest group
    mean, in (prompt_id, pass) order; follow ``next_cursor`` for more."""
    return await accounting.prompts(
        session, run_id, state=state, limit=limit, cursor=cursor, pool=pool
    )


@router.get("/accounting/dead-letters", response_model=DeadLetterPage, responses=_CURSOR_400)
async def list_dead_letters(
    run_id: RunId,
    session: Session,
    accounting: Accounting,
    limit: Limit = 100,
    cursor: str | None = None,
) -> DeadLetterPage:
    """Events the drain could not apply, with their error; they are not in the totals."""
    return await accounting.dead_letters(session, run_id, limit=limit, cursor=cursor)
