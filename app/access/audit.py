"""The audit log of operator actions (SPEC "Access control"): who (the token's name) did what,
to which run, when, with what.

A run action changes Redis, so its entry is written there, by the script that makes the change,
in the same call: to the run's outbox, the stream ``<prefix>:{<run_id>}:audit``
(``app.caller.action_entry``, ``lua/lib/audit.lua``). :func:`move_run` moves a run's outbox into
Postgres, right after each action (:class:`OutboxLog`), and :func:`move_all` every run's, from
the audit worker loop (workers/audit.py), with what is left in the stream ``<prefix>:audit``
that versions before the outboxes wrote. Each entry keeps where it came from (``source``,
unique), so a move made twice (after a crash, or by two processes at once) inserts it once, and
leaves the stream only once it is in Postgres. A token action changes Postgres, so its entry is
written in the same transaction (:func:`add`). Reading (:func:`entries`) reads the rows only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

import orjson
from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.access.models import AuditEntry
from app.caller import Caller, action_fields

FLUSH_BATCH: Final = 500  # entries one read of a stream takes, and rows one INSERT writes
RUN_CHUNK: Final = 1000  # runs whose outboxes one pipelined read takes

ACTIONS: Final = (
    "run.create",
    "run.config",
    "run.close",
    "run.delete",
    "run.policy",
    "token.create",
    "token.revoke",
)

Sessions = async_sessionmaker[AsyncSession]


def add(
    session: AsyncSession,
    caller: Caller,
    action: str,
    run_id: str | None,
    detail: Mapping[str, Any],
) -> None:
    """Add a token action's entry to the caller's Postgres transaction."""
    session.add(AuditEntry(at=datetime.now(UTC), **action_fields(caller, action, run_id, detail)))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _rows(
    batch: Sequence[Any] | None, run_id: str | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of stream entries read from ``run_id``'s outbox (None: the old stream), and
    their stream ids. The ``source`` of an outbox's entry is ``<stream id>-<run_id>`` (two
    runs' outboxes may give one id; the stream id first, as the readers of the version before
    the outboxes parse it), the old stream's its stream id alone (what its movers wrote). Its
    time is the stream id's, or, in the old stream, the ``at_ms`` it carries."""
    rows, ids = [], []
    for sid, fields in batch or ():
        if sid is None or fields is None:  # an entry Redis reports without its fields
            continue
        ids.append(_text(sid))
        entry = orjson.loads(fields.get(b"e") or fields.get("e") or b"{}")
        at_ms = entry.pop("at_ms", None) or int(ids[-1].partition("-")[0])
        source = ids[-1] if run_id is None else f"{ids[-1]}-{run_id}"
        rows.append({**entry, "at": datetime.fromtimestamp(at_ms / 1000, UTC), "source": source})
    return rows, ids


async def _insert(sessionmaker: Sessions, rows: list[dict[str, Any]]) -> None:
    """Insert the rows, in order, but those already in (by ``source``), in one transaction."""
    if not rows:
        return
    async with sessionmaker() as session, session.begin():
        for start in range(0, len(rows), FLUSH_BATCH):
            await session.execute(
                insert(AuditEntry)
                .values(rows[start : start + FLUSH_BATCH])
                .on_conflict_do_nothing(index_elements=["source"])
            )


async def _move_stream(redis: Redis, stream: str, run_id: str | None, sessions: Sessions) -> int:
    """Move every entry of one stream into Postgres; returns how many moved."""
    moved = 0
    while True:
        batch = await redis.xrange(stream, count=FLUSH_BATCH)
        rows, ids = _rows(batch, run_id)
        await _insert(sessions, rows)
        if ids:
            await redis.xdel(stream, *ids)
        moved += len(rows)
        if len(batch or ()) < FLUSH_BATCH:
            return moved


async def move_run(redis: Redis, prefix: str, run_id: str, sessionmaker: Sessions) -> int:
    """Move the run's outbox into Postgres; returns how many entries moved. Safe to run in
    several processes at once: an entry is inserted once, and removed from the outbox only once
    it is in Postgres."""
    return await _move_stream(redis, keys.outbox_key(prefix, run_id), run_id, sessionmaker)


class OutboxLog:
    """The :class:`app.caller.ActionLog` of the API processes: moves a run's outbox into
    Postgres (:func:`move_run`)."""

    def __init__(self, redis: Redis, prefix: str, sessionmaker: Sessions) -> None:
        self.redis = redis
        self.prefix = prefix
        self.sessionmaker = sessionmaker

    async def moved(self, run_id: str) -> int:
        return await move_run(self.redis, self.prefix, run_id, self.sessionmaker)


async def move_all(redis: Redis, prefix: str, sessionmaker: Sessions) -> int:
    """Move every outbox of the runs in the run index, and what is left in the old stream,
    into Postgres; returns how many entries moved. A deleted run whose outbox is then empty
    leaves the run index, as its delete's request (which may have failed to move the outbox, or
    died first) would have had it (``RedisStore.unlist``). An outbox that
    could not be emptied (its Redis refuses writes) is left for the next pass, once the others
    have moved; then the first such error is raised."""
    moved = await _move_stream(redis, keys.audit_key(prefix), None, sessionmaker)
    failed: list[BaseException] = []
    chunk: list[str] = []
    async for member, _ in redis.zscan_iter(keys.runs_key(prefix), count=RUN_CHUNK):
        chunk.append(_text(member))
        if len(chunk) == RUN_CHUNK:
            moved += await _move_runs(redis, prefix, chunk, sessionmaker, failed)
            chunk = []
    moved += await _move_runs(redis, prefix, chunk, sessionmaker, failed)
    if failed:
        raise failed[0]
    return moved


async def _move_runs(
    redis: Redis,
    prefix: str,
    run_ids: list[str],
    sessionmaker: Sessions,
    failed: list[BaseException],
) -> int:
    """Move the runs' outboxes: one pipelined read of them all (and of each run's status), one
    transaction, one pipelined XDEL of what moved; an outbox with more than one read's worth is
    then moved on its own. The error of an outbox that could not be emptied goes to
    ``failed``."""
    run_ids = list(dict.fromkeys(run_ids))  # a scan may name a run twice
    if not run_ids:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for rid in run_ids:
            # The status first: a deleted run's outbox read after it holds every entry it will
            # ever hold (a tombstone takes no action), so once moved the run may leave the index.
            pipe.hget(keys.run_key(prefix, rid), "st")
            pipe.xrange(keys.outbox_key(prefix, rid), count=FLUSH_BATCH)
        replies = await pipe.execute()
    read = {rid: _rows(batch, rid) for rid, batch in zip(run_ids, replies[1::2], strict=True)}
    full = {
        rid
        for rid, batch in zip(run_ids, replies[1::2], strict=True)
        if len(batch or ()) >= FLUSH_BATCH
    }
    await _insert(sessionmaker, [row for rows, _ in read.values() for row in rows])
    pending = [rid for rid, (_, ids) in read.items() if ids]
    errors: dict[str, Any] = {}
    if pending:
        async with redis.pipeline(transaction=False) as pipe:
            for rid in pending:
                pipe.xdel(keys.outbox_key(prefix, rid), *read[rid][1])
            errors = dict(zip(pending, await pipe.execute(raise_on_error=False), strict=True))
    moved, gone = 0, []
    for rid, st in zip(run_ids, replies[0::2], strict=True):
        error = errors.get(rid)
        if isinstance(error, BaseException):
            failed.append(error)
        elif rid in full:
            moved += len(read[rid][0]) + await move_run(redis, prefix, rid, sessionmaker)
        else:
            moved += len(read[rid][0])
            if st is not None and _text(st) == "deleted":
                gone.append(rid)
    for rid in gone:  # as the delete's request would have: the empty outbox, then the entry
        await redis.delete(keys.outbox_key(prefix, rid))
        await redis.zrem(keys.runs_key(prefix), rid)
    return moved


async def entries(
    session: AsyncSession,
    caller: Caller,
    run_id: str | None,
    limit: int,
    before: int | None,
) -> tuple[list[AuditEntry], int | None]:
    """A page of entries, newest first (by row id: the order they reached Postgres in), below
    row id ``before``, and the ``before`` of the next page (None: no more). A caller sees the
    entries of the runs it may touch, and those of no run (token actions) only when it is not
    limited to runs; a limited caller's page may hold fewer than ``limit``. Nothing is
    written."""
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
