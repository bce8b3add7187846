"""The audit loop moves the audit stream's entries into Postgres, each exactly once, however
many loops run at once; reading the audit log meanwhile lists every entry once, in one order,
wherever it is (app/access/audit.py)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.access import audit
from app.access.models import AuditEntry
from app.caller import Caller
from workers.audit import run_audit

OPS = Caller(token_id="t-1", name="ops", scopes=frozenset({"operate"}))


async def _rows(sessionmaker: async_sessionmaker[AsyncSession]) -> list[tuple[str, str]]:
    async with sessionmaker() as session:
        rows = await session.execute(
            select(AuditEntry.source, AuditEntry.run_id).order_by(AuditEntry.id)
        )
    return [(source, run_id) for source, run_id in rows.all()]


async def _count(sessionmaker: async_sessionmaker[AsyncSession]) -> int:
    async with sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(AuditEntry)) or 0)


async def test_two_loops_move_every_entry_once_in_stream_order(
    redis: Redis, prefix: str, sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    stream = keys.audit_key(prefix)
    stop = asyncio.Event()
    moved = [0, 0]
    loops = [
        asyncio.create_task(
            run_audit(redis, stream, sessionmaker, 0.01, stop, lambda i=i: moved.__setitem__(i, 1))
        )
        for i in range(2)
    ]
    written = []
    try:
        for n in range(1200):  # more than one move's batch, written while both loops move
            await audit.record(redis, stream, OPS, "run.config", f"run-{n}", {"n": n})
            written.append(f"run-{n}")
            if n % 100 == 0:
                await asyncio.sleep(0.01)
        for _ in range(1500):  # 30 s
            if not await redis.xlen(stream) and await _count(sessionmaker) >= len(written):
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.gather(*loops)
    assert moved == [1, 1]  # both passed
    rows = await _rows(sessionmaker)
    assert [run_id for _, run_id in rows] == written  # once each, row ids in stream order
    assert len({source for source, _ in rows}) == len(written)


async def test_a_read_across_a_move_lists_every_entry_once(
    redis: Redis, prefix: str, sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    """Pages read before, during and after the move of the entries they list: a cursor of an
    entry still in the stream pages on once it has moved, and the reverse."""
    stream = keys.audit_key(prefix)
    for n in range(4):
        await audit.record(redis, stream, OPS, "run.create", f"r-{n}", {})
    await audit.flush(redis, stream, sessionmaker)
    for n in range(4, 10):
        await audit.record(redis, stream, OPS, "run.create", f"r-{n}", {})

    async def page(before: int | None) -> tuple[list[str | None], int | None]:
        async with sessionmaker() as session:
            rows, after = await audit.entries(session, redis, stream, OPS, None, 3, before)
        return [r.run_id for r in rows], after

    first, cursor = await page(None)
    assert first == ["r-9", "r-8", "r-7"] and cursor is not None
    assert cursor >= audit.PENDING_MIN  # an entry still in the stream
    await audit.flush(redis, stream, sessionmaker)  # everything moves between two pages
    second, cursor = await page(cursor)
    assert second == ["r-6", "r-5", "r-4"] and cursor is not None
    assert cursor < audit.PENDING_MIN
    await audit.record(redis, stream, OPS, "run.create", "r-10", {})  # newer: not on later pages
    third, cursor = await page(cursor)
    assert third == ["r-3", "r-2", "r-1"]
    fourth, cursor = await page(cursor)
    assert fourth == ["r-0"] and cursor is None
