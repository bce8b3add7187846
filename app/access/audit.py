"""The audit log of operator actions (SPEC "Access control"): who (the token's name) did what,
to which run, when, with what.

A run action changes Redis, so its entry is written there too, right after the change, to the
stream ``<prefix>:audit`` (:func:`record`); :func:`flush` moves entries into Postgres
(idempotently: each keeps its stream id), from the audit worker loop (workers/audit.py). A token
action changes Postgres, so its entry is written in the same transaction (:func:`add`).

Reading (:func:`entries`) writes nothing: an entry not yet moved is read from the stream, and
listed above the rows, where the move will put it (a move gives the entries row ids above every
row's, in stream order). Until then its ``id`` is made of its stream id (:func:`pending_id`),
above every row id; a cursor of either kind pages on as if every entry had been moved at once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

import orjson
from redis.asyncio import Redis
from sqlalchemy import BigInteger, cast, func, or_, select, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.access.models import AuditEntry
from app.caller import Caller

FLUSH_BATCH: Final = 500

ACTIONS: Final = (
    "run.create",
    "run.config",
    "run.close",
    "run.delete",
    "run.policy",
    "token.create",
    "token.revoke",
)


def _fields(
    caller: Caller, action: str, run_id: str | None, detail: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "actor": caller.name,
        "token_id": caller.token_id,
        "action": action,
        "run_id": run_id,
        "detail": dict(detail),
    }


async def record(
    redis: Redis,
    stream: str,
    caller: Caller,
    action: str,
    run_id: str | None,
    detail: Mapping[str, Any],
) -> None:
    """Write a run action's entry to the audit stream (Postgres gets it at the next flush)."""
    entry = _fields(caller, action, run_id, detail)
    entry["at_ms"] = int(time.time() * 1000)
    await redis.xadd(stream, {"e": orjson.dumps(entry)})


class StreamActionLog:
    """The :class:`app.caller.ActionLog` of the API processes: run actions go to the audit stream
    (:func:`record`)."""

    def __init__(self, redis: Redis, stream: str) -> None:
        self.redis = redis
        self.stream = stream

    async def record(
        self, caller: Caller, action: str, run_id: str | None, detail: Mapping[str, Any]
    ) -> None:
        await record(self.redis, self.stream, caller, action, run_id, detail)


def add(
    session: AsyncSession,
    caller: Caller,
    action: str,
    run_id: str | None,
    detail: Mapping[str, Any],
) -> None:
    """Add a token action's entry to the caller's Postgres transaction."""
    session.add(AuditEntry(at=datetime.now(UTC), **_fields(caller, action, run_id, detail)))


def _decoded(sid: Any, fields: Any) -> dict[str, Any] | None:
    """The row of one stream entry (None for an entry Redis reports without fields)."""
    if sid is None or fields is None:
        return None
    source = sid.decode() if isinstance(sid, bytes) else str(sid)
    entry = orjson.loads(fields.get(b"e") or fields.get("e") or b"{}")
    at = datetime.fromtimestamp(entry.pop("at_ms") / 1000, UTC)
    return {**entry, "at": at, "source": source}


async def flush(redis: Redis, stream: str, sessionmaker: async_sessionmaker[AsyncSession]) -> int:
    """Move every entry of the audit stream into Postgres; returns how many moved. Safe to run
    in several processes at once: an entry is inserted once (its stream id is unique) and
    removed from the stream only once it is in Postgres."""
    moved = 0
    while True:
        batch = await redis.xrange(stream, count=FLUSH_BATCH)
        if not batch:
            return moved
        rows = [row for sid, fields in batch if (row := _decoded(sid, fields)) is not None]
        if rows:
            async with sessionmaker() as session, session.begin():
                await session.execute(
                    insert(AuditEntry)
                    .values(rows)
                    .on_conflict_do_nothing(index_elements=["source"])
                )
        await redis.xdel(stream, *(row["source"] for row in rows))
        moved += len(batch)
        if len(batch) < FLUSH_BATCH:
            return moved


# Row ids count the entries: they stay far below this, and every id made of a stream id
# (milliseconds since 1970 times 1000, plus the sequence) is above it.
PENDING_MIN: Final = 10**15


def pending_id(source: str) -> int:
    """The ``id`` an entry still in the stream is listed with, in stream order (an entry's
    sequence number within its millisecond is below 1000: each is an HTTP request)."""
    ms, seq = source.split("-")
    return int(ms) * 1000 + int(seq)


def _source_of(pending: int) -> tuple[int, int]:
    return divmod(pending, 1000)


def _visible(row: Mapping[str, Any], caller: Caller, run_id: str | None) -> bool:
    """The filter of :func:`entries`' query, on an entry of the stream."""
    if run_id is not None and row.get("run_id") != run_id:
        return False
    return caller.every_run or row.get("run_id") is not None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _pending(
    redis: Redis, stream: str, caller: Caller, run_id: str | None, n: int, below: str | None
) -> list[AuditEntry]:
    """Up to ``n`` entries of the stream, newest first, below stream id ``below``: read only
    (XREVRANGE), as transient rows that no session holds."""
    out: list[AuditEntry] = []
    top = "+" if below is None else f"({below}"
    while len(out) < n:
        batch = await redis.xrevrange(stream, max=top, min="-", count=FLUSH_BATCH) or []
        for sid, fields in batch:
            row = _decoded(sid, fields)
            if row is not None and _visible(row, caller, run_id):
                out.append(AuditEntry(id=pending_id(row["source"]), **row))
        if len(batch) < FLUSH_BATCH:
            break
        top = "(" + _text(batch[-1][0])
    return out[:n]


async def entries(
    session: AsyncSession,
    redis: Redis,
    stream: str,
    caller: Caller,
    run_id: str | None,
    limit: int,
    before: int | None,
) -> tuple[list[AuditEntry], int | None]:
    """A page of entries, newest first, and the ``before`` of the next page (None: no more):
    those still in the stream, then the rows. A caller sees the entries of the runs it may
    touch, and those of no run (token actions) only when it is not limited to runs; a limited
    caller's page may hold fewer than ``limit``. Nothing is written."""
    pending: list[AuditEntry] = []
    below: tuple[int, int] | None = None  # a pending cursor: the stream id it stands for
    if before is None or before >= PENDING_MIN:
        if before is not None:
            below = _source_of(before)
        cursor = None if below is None else f"{below[0]}-{below[1]}"
        pending = await _pending(redis, stream, caller, run_id, limit + 1, cursor)
    rows = pending
    if len(pending) <= limit:
        rows = pending + await _rows(
            session, caller, run_id, limit + 1 - len(pending), before, below, pending
        )
    after = rows[limit - 1].id if len(rows) > limit else None
    rows = rows[:limit]
    return [r for r in rows if r.run_id is None or caller.may_touch(r.run_id)], after


async def _rows(
    session: AsyncSession,
    caller: Caller,
    run_id: str | None,
    n: int,
    before: int | None,
    below: tuple[int, int] | None,
    pending: list[AuditEntry],
) -> list[AuditEntry]:
    """Up to ``n`` rows, newest first: below row id ``before``, or, after a pending cursor,
    every row but those moved from the stream at or above it (listed already as pending);
    never one of ``pending`` (an entry moved while it was read)."""
    q = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(n)
    if run_id is not None:
        q = q.where(AuditEntry.run_id == run_id)
    if before is not None and before < PENDING_MIN:
        q = q.where(AuditEntry.id < before)
    if below is not None:
        source = (
            cast(func.split_part(AuditEntry.source, "-", part), BigInteger) for part in (1, 2)
        )
        q = q.where(or_(AuditEntry.source.is_(None), tuple_(*source) < tuple_(*below)))
    if pending:
        q = q.where(
            or_(
                AuditEntry.source.is_(None),
                AuditEntry.source.not_in([p.source for p in pending]),
            )
        )
    if not caller.every_run:
        q = q.where(AuditEntry.run_id.is_not(None))
    return list(await session.scalars(q))
