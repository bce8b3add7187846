"""The accounting's listings, a page at a time: the batch ledger in lease order, the prompt
ledger in (prompt_id, pass) order, and a run's dead letters, each with the cursor of its next
page."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import UTC, datetime

from sqlalchemy import and_, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from app.accounting.models import PASS_STATES, Batch, PromptMean, PromptPass
from app.accounting.pools import POOLS, pool_condition, run_thresholds
from app.accounting.queries import require_run
from app.accounting.schemas import (
    BatchPage,
    BatchRecord,
    DeadLetter,
    DeadLetterPage,
    PromptPage,
    PromptPassRecord,
)
from app.accounting.stream import EventStream
from app.errors import BadRequest, ValidationFailed
from app.events import EventError, StreamId

__all__ = ["dead_letters", "list_batches", "list_prompts"]

_BIGINT_MAX = 2**63 - 1


def _encode_cursor(batch: Batch) -> str:
    raw = json.dumps([batch.event_ms, batch.event_seq, batch.batch_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[int, int, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        ms, seq, batch_id = json.loads(raw)
        # Only what the ledger can hold: Postgres refuses NUL in text and ints beyond bigint.
        if not (
            all(type(n) is int and -_BIGINT_MAX - 1 <= n <= _BIGINT_MAX for n in (ms, seq))
            and isinstance(batch_id, str)
            and "\x00" not in batch_id
        ):
            raise ValueError(cursor)
    except (binascii.Error, ValueError, TypeError):
        raise BadRequest("invalid cursor") from None
    return ms, seq, batch_id


async def list_batches(
    session: AsyncSession, stream: EventStream, run_id: str, *, limit: int, cursor: str | None
) -> BatchPage:
    """The batch ledger in lease order, ``limit`` rows after ``cursor``."""
    await require_run(session, stream, run_id)
    query = select(Batch).where(Batch.run_id == run_id)
    if cursor is not None:
        query = query.where(
            tuple_(Batch.event_ms, Batch.event_seq, Batch.batch_id)
            > tuple_(*_decode_cursor(cursor))
        )
    query = query.order_by(Batch.event_ms, Batch.event_seq, Batch.batch_id).limit(limit + 1)
    rows = list((await session.scalars(query)).all())
    more = len(rows) > limit
    rows = rows[:limit]
    return BatchPage(
        batches=[BatchRecord.model_validate(row, from_attributes=True) for row in rows],
        next_cursor=_encode_cursor(rows[-1]) if more else None,
    )


def _encode_prompt_cursor(prompt_id: str, pass_: int) -> str:
    raw = json.dumps([prompt_id, pass_]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_prompt_cursor(cursor: str) -> tuple[str, int]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        prompt_id, pass_ = json.loads(raw)
        # Only what the ledger can hold: Postgres refuses NUL in text and ints beyond bigint.
        if not (
            isinstance(prompt_id, str)
            and "\x00" not in prompt_id
            and type(pass_) is int
            and 1 <= pass_ <= _BIGINT_MAX
        ):
            raise ValueError(cursor)
    except (binascii.Error, ValueError, TypeError):
        raise ValidationFailed("invalid cursor") from None
    return prompt_id, pass_


async def list_prompts(
    session: AsyncSession,
    stream: EventStream,
    run_id: str,
    *,
    state: str | None,
    limit: int,
    cursor: str | None,
    pool: str | None = None,
) -> PromptPage:
    """The prompt ledger in (prompt_id, pass) order, of one state or all, of one difficulty
    pool or all, ``limit`` passes after ``cursor``; each with its prompt's newest group mean."""
    if state is not None and state not in PASS_STATES:
        raise ValidationFailed(f"state must be one of {', '.join(PASS_STATES)}, not {state!r}")
    if pool is not None and pool not in POOLS:
        raise ValidationFailed(f"pool must be one of {', '.join(POOLS)}, not {pool!r}")
    after = _decode_prompt_cursor(cursor) if cursor is not None else None
    await require_run(session, stream, run_id)
    query = (
        select(PromptPass, PromptMean.mean)
        .outerjoin(
            PromptMean,
            and_(
                PromptMean.run_id == PromptPass.run_id, PromptMean.prompt_id == PromptPass.prompt_id
            ),
        )
        .where(PromptPass.run_id == run_id)
    )
    if pool is not None:
        thresholds = await run_thresholds(session, run_id)
        if thresholds is None:
            raise ValidationFailed(
                f"pool needs a run with difficulty pools: run {run_id!r} has no difficulty"
            )
        query = query.where(pool_condition(pool, thresholds))
    if state is not None:
        query = query.where(PromptPass.state == state)
    if after is not None:
        query = query.where(tuple_(PromptPass.prompt_id, PromptPass.pass_) > tuple_(*after))
    query = query.order_by(PromptPass.prompt_id, PromptPass.pass_).limit(limit + 1)
    rows = list((await session.execute(query)).all())
    more = len(rows) > limit
    rows = rows[:limit]
    return PromptPage(
        prompts=[
            PromptPassRecord(
                prompt_id=row.prompt_id,
                pass_=row.pass_,
                attempt=row.attempt,
                state=row.state,
                tries=row.tries,
                mean=mean,
            )
            for row, mean in rows
        ],
        next_cursor=_encode_prompt_cursor(rows[-1][0].prompt_id, rows[-1][0].pass_)
        if more
        else None,
    )


async def dead_letters(
    session: AsyncSession, stream: EventStream, run_id: str, *, limit: int, cursor: str | None
) -> DeadLetterPage:
    """The run's dead-letter stream, oldest first."""
    await require_run(session, stream, run_id)
    if cursor is not None:
        try:
            StreamId.parse(cursor)
        except EventError:
            raise BadRequest("invalid cursor") from None
    records = await stream.dead_letters(run_id, after=cursor, count=limit + 1)
    more = len(records) > limit
    records = records[:limit]
    page = []
    for record in records:
        event = record.fields.get(b"e")
        payload = record.fields.get(b"d")
        page.append(
            DeadLetter(
                dead_id=record.dead_id,
                stream_id=record.stream_id,
                event=event.decode("utf-8", "replace") if event is not None else None,
                payload=base64.b64encode(payload).decode() if payload is not None else None,
                error=record.error,
                deliveries=record.deliveries,
                consumer=record.consumer,
                dead_at=datetime.fromtimestamp(record.dead_at_ms / 1000, tz=UTC),
            )
        )
    return DeadLetterPage(
        count=await stream.dead_letter_count(run_id),
        dead_letters=page,
        next_cursor=records[-1].dead_id if more else None,
    )
