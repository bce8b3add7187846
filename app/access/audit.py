"""The audit log of operator actions (SPEC "Access control"): who (the token's name) did what,
to which run, when, with what.

A run action changes Redis, so its entry is written there too, right after the change, to the
stream ``<prefix>:audit`` (:func:`record`); :func:`flush` moves entries into Postgres
(idempotently: each keeps its stream id), from the drain worker and before every read. A token
action changes Postgres, so its entry is written in the same transaction (:func:`add`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

import orjson
from redis.asyncio import Redis
from sqlalchemy import select
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


async def flush(redis: Redis, stream: str, sessionmaker: async_sessionmaker[AsyncSession]) -> int:
    """Move every entry of the audit stream into Postgres; returns how many moved. Safe to run
    in several processes at once: an entry is inserted once (its stream id is unique) and
    removed from the stream only once it is in Postgres."""
    moved = 0
    while True:
        batch = await redis.xrange(stream, count=FLUSH_BATCH)
        if not batch:
            return moved
        rows, ids = [], []
        for sid, fields in batch:
            if sid is None or fields is None:
                continue
            source = sid.decode() if isinstance(sid, bytes) else str(sid)
            ids.append(source)
            entry = orjson.loads(fields.get(b"e") or fields.get("e") or b"{}")
            at = datetime.fromtimestamp(entry.pop("at_ms") / 1000, UTC)
            rows.append({**entry, "at": at, "source": source})
        if rows:
            async with sessionmaker() as session, session.begin():
                await session.execute(
                    insert(AuditEntry)
                    .values(rows)
                    .on_conflict_do_nothing(index_elements=["source"])
                )
        await redis.xdel(stream, *ids)
        moved += len(batch)
        if len(batch) < FLUSH_BATCH:
            return moved


async def entries(
    session: AsyncSession,
    caller: Caller,
    run_id: str | None,
    limit: int,
    before: int | None,
) -> tuple[list[AuditEntry], int | None]:
    """A page of entries, newest first, and the ``before`` of the next page (None: no more).
    A caller sees the entries of the runs it may touch, and those of no run (token actions)
    only when it is not limited to runs; a limited caller's page may hold fewer than ``limit``."""
    q = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit + 1)
    if run_id is not None:
        q = q.where(AuditEntry.run_id == run_id)
    if before is not None:
        q = q.where(AuditEntry.id < before)
    if not caller.every_run:
        q = q.where(AuditEntry.run_id.is_not(None))
    rows = list(await session.scalars(q))
    after = rows[limit - 1].id if len(rows) > limit else None
    rows = rows[:limit]
    return [r for r in rows if r.run_id is None or caller.may_touch(r.run_id)], after
