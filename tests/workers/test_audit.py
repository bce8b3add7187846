"""The audit loop moves every run's outbox into Postgres, each entry exactly once however many
loops run at once, and what an older version left in its global stream; a deleted run's entry
outlives the run's keys and a crash at any step of its delete (app/access/audit.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import orjson
import pytest
from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.access import audit
from app.access.models import AuditEntry
from app.broker.config import RunConfig
from app.broker.store import RedisStore
from app.caller import action_entry
from tests.helpers import OPS
from workers.audit import run_audit

Sessions = async_sessionmaker[AsyncSession]


async def _rows(sessionmaker: Sessions) -> list[AuditEntry]:
    async with sessionmaker() as session:
        return list(await session.scalars(select(AuditEntry).order_by(AuditEntry.id)))


async def _outboxes(redis: Redis, prefix: str, run_ids: list[str]) -> int:
    return sum([await redis.xlen(keys.outbox_key(prefix, rid)) for rid in run_ids])


async def test_two_loops_move_every_outbox_once_each_in_stream_order(
    redis: Redis, prefix: str, sessionmaker: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small reads, so that a pass takes several chunks of runs and an outbox several reads.
    monkeypatch.setattr(audit, "RUN_CHUNK", 7)
    monkeypatch.setattr(audit, "FLUSH_BATCH", 5)
    runs = [f"run-{n}" for n in range(30)]
    await redis.zadd(keys.runs_key(prefix), dict.fromkeys(runs, 1))
    stop = asyncio.Event()
    passed = [0, 0]
    loops = [
        asyncio.create_task(
            run_audit(redis, prefix, sessionmaker, 0.01, stop, lambda i=i: passed.__setitem__(i, 1))
        )
        for i in range(2)
    ]
    written: dict[str, list[str]] = {rid: [] for rid in runs}
    try:
        for n in range(300):  # written while both loops move
            rid = runs[n % 7 if n < 150 else n % len(runs)]  # a few runs get many entries
            sid = await redis.xadd(
                keys.outbox_key(prefix, rid),
                {"e": action_entry(OPS, "run.policy", rid, {"version": n})},
            )
            written[rid].append(sid.decode())
            if n % 50 == 0:
                await asyncio.sleep(0.01)
        for _ in range(1500):  # 30 s
            if not await _outboxes(redis, prefix, runs) and len(await _rows(sessionmaker)) >= 300:
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.gather(*loops)
    assert passed == [1, 1]  # both passed
    rows = await _rows(sessionmaker)
    assert len(rows) == 300 and len({r.source for r in rows}) == 300  # once each
    for rid, sids in written.items():
        assert [r.source for r in rows if r.run_id == rid] == [f"{s}-{rid}" for s in sids]
    assert all(r.at == _at(r.source) for r in rows)  # the time is the stream id's
    assert await redis.zcard(keys.runs_key(prefix)) == len(runs)  # no run was deleted


def _at(source: str | None) -> datetime:
    assert source is not None
    return datetime.fromtimestamp(int(source.partition("-")[0]) / 1000, UTC)


async def test_the_entries_an_older_version_left_in_its_stream_are_moved(
    redis: Redis, prefix: str, sessionmaker: Sessions
) -> None:
    """Before the outboxes, an entry went to one global stream after the change, carrying its
    time; what an upgrade finds there is moved, once, with the source it had."""
    stream = keys.audit_key(prefix)
    old = [
        {"actor": "ops", "token_id": "t-1", "action": "run.close", "run_id": f"old-{n}",
         "detail": {}, "at_ms": 1_700_000_000_000 + n}
        for n in range(3)
    ]  # fmt: skip
    sids = [(await redis.xadd(stream, {"e": orjson.dumps(e)})).decode() for e in old]
    # An older worker moved the first, and died before its XDEL.
    async with sessionmaker() as session, session.begin():
        row = {k: v for k, v in old[0].items() if k != "at_ms"}
        session.add(AuditEntry(**row, at=datetime.now(UTC), source=sids[0]))

    await audit.move_all(redis, prefix, sessionmaker)
    rows = await _rows(sessionmaker)
    assert [(r.run_id, r.source) for r in rows] == [(f"old-{n}", sids[n]) for n in range(3)]
    assert [r.at.timestamp() for r in rows[1:]] == [1_700_000_000.001, 1_700_000_000.002]
    assert await redis.xlen(stream) == 0


async def test_a_deleted_runs_entries_outlive_its_keys_and_a_crash_at_each_step(
    store: RedisStore, redis: Redis, prefix: str, sessionmaker: Sessions
) -> None:
    """The delete's steps as the endpoint takes them: delete (the tombstone and its entry),
    move the outbox, take the run out of the run index. A process that dies after the first
    or the second leaves the tombstone in the index, where the loop finishes the job."""
    for rid in ("crashed-after-delete", "crashed-after-move"):
        await store.create_run(rid, RunConfig(), entry=action_entry(OPS, "run.create", rid, {}))
        await store.close_run(rid, entry=action_entry(OPS, "run.close", rid, {}))
        await redis.xgroup_create(keys.events_key(prefix, rid), keys.CONSUMER_GROUP, id="$")
        await store.delete_run(rid, entry=action_entry(OPS, "run.delete", rid, {}))
    await audit.move_run(redis, prefix, "crashed-after-move", sessionmaker)
    assert [r.action for r in await _rows(sessionmaker)] == [
        "run.create",
        "run.close",
        "run.delete",
    ]
    # Of the run that died right after its delete, only the tombstone and the outbox are left,
    # and the listing does not show it.
    base = keys.run_base(prefix, "crashed-after-delete")
    left = {k.decode() async for k in redis.scan_iter(match=base + "*")}
    assert left == {keys.run_key(prefix, "crashed-after-delete"), base + keys.OUTBOX}
    assert (await store.list_runs()).runs == []

    await audit.move_all(redis, prefix, sessionmaker)
    rows = await _rows(sessionmaker)
    assert [(r.run_id, r.action) for r in rows[3:]] == [
        ("crashed-after-delete", "run.create"),
        ("crashed-after-delete", "run.close"),
        ("crashed-after-delete", "run.delete"),
    ]
    assert await redis.zcard(keys.runs_key(prefix)) == 0  # both left the index
    assert not await redis.exists(base + keys.OUTBOX)
    await audit.move_all(redis, prefix, sessionmaker)
    assert len(await _rows(sessionmaker)) == 6
