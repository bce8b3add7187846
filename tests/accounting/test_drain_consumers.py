"""Drain consumers come and go without slowing the accounting or piling up in the groups: a
consumer whose heartbeat stops is taken over within ``heartbeat_timeout_ms``, one that stops
cleanly leaves, and consumers from before heartbeats are deleted once idle and empty
(issue 10, item 4; the same with real worker processes: tests/workers/test_drain_restarts.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
from accounting_helpers import RunSim, register_run, xadd_events
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.accounting.drain import DrainCounts
from app.accounting.stream import EventStream
from app.events import StreamId
from app.keys import CONSUMER_GROUP, drain_consumers_key, events_key
from workers.drain import DrainContext, drain_once, run_drain

TIMEOUT_MS = 300


async def _drain(ctx: DrainContext, **kw: Any) -> DrainCounts:
    """Passes until one reads nothing; their counts."""
    total = DrainCounts()
    for _ in range(50):
        counts = await drain_once(ctx, **kw)
        total.add(counts)
        if counts.read == 0 and counts.missing == 0:
            return total
    raise AssertionError("still reading after 50 passes")


async def _consumers(redis: Redis, prefix: str, run_id: str) -> dict[str, int]:
    """Consumer name -> pending entries, of the run's group."""
    rows = await redis.xinfo_consumers(events_key(prefix, run_id), CONSUMER_GROUP)
    return {r["name"].decode(): int(r["pending"]) for r in rows}


async def _registered(redis: Redis, prefix: str) -> set[str]:
    return {n.decode() for n in await redis.zrange(drain_consumers_key(prefix), 0, -1)}


async def _applied(sm: async_sessionmaker[AsyncSession], run_id: str) -> set[StreamId]:
    async with sm() as s:
        return await repository.processed_ids(s, run_id)


async def _run_with_events(redis: Redis, prefix: str, run_id: str, steps: int = 30) -> list[bytes]:
    sim = RunSim(run_id, seed=7)
    sim.workload(steps)
    await register_run(redis, prefix, run_id)
    return await xadd_events(redis, prefix, run_id, sim.events)


async def _crashed_holding(ctx: DrainContext, run_id: str, count: int) -> int:
    """A consumer that beat, read ``count`` entries and died before applying them."""
    await ctx.drainer.beat()
    await ctx.drainer.streams()
    held = await ctx.drainer.stream.read_new([run_id], ctx.drainer.consumer, count, None)
    return len(held[run_id])


async def test_a_silent_consumer_is_taken_over_and_deleted(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    ids = await _run_with_events(redis, prefix, run_id)
    dead = make_ctx(consumer="dead", heartbeat_timeout_ms=TIMEOUT_MS)
    assert await _crashed_holding(dead, run_id, 5) == 5

    # The survivor drains the rest at once; the dead one's entries wait for its silence
    # (claim_idle_ms, the fallback, is far away). Its last heartbeat is kept fresh here, so
    # that a slow machine does not make it silent before its time.
    live = make_ctx(consumer="live", heartbeat_timeout_ms=TIMEOUT_MS)
    while True:
        await dead.drainer.beat()
        counts = await drain_once(live)
        assert counts.taken_over == 0
        if counts.read == 0:
            break
    assert await _consumers(redis, prefix, run_id) == {"dead": 5, "live": 0}
    assert len(await _applied(sessionmaker, run_id)) == len(ids) - 5

    await asyncio.sleep(TIMEOUT_MS / 1000)
    counts = await _drain(live)
    assert (counts.taken_over, counts.consumers_deleted) == (5, 1)
    assert await _applied(sessionmaker, run_id) == {StreamId.parse(i) for i in ids}
    assert await _consumers(redis, prefix, run_id) == {"live": 0}
    assert await _registered(redis, prefix) == {"live"}


async def test_a_consumer_that_beats_keeps_its_entries(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
) -> None:
    await _run_with_events(redis, prefix, run_id)
    slow = make_ctx(consumer="slow", heartbeat_timeout_ms=TIMEOUT_MS)
    assert await _crashed_holding(slow, run_id, 3) == 3  # held, not dead: a long commit
    live = make_ctx(consumer="live", heartbeat_timeout_ms=TIMEOUT_MS)
    for _ in range(8):  # over twice the timeout
        await slow.drainer.beat()
        assert (await drain_once(live, claim=False)).taken_over == 0
        await asyncio.sleep(TIMEOUT_MS / 4000)
    assert (await _consumers(redis, prefix, run_id))["slow"] == 3


async def test_a_stopped_drain_leaves_its_groups(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    ids = await _run_with_events(redis, prefix, run_id)
    ctx = make_ctx(consumer="leaving", heartbeat_timeout_ms=TIMEOUT_MS, block_ms=20)
    stop = asyncio.Event()
    task = asyncio.create_task(run_drain(ctx, stop))
    try:
        for _ in range(500):
            if len(await _applied(sessionmaker, run_id)) == len(ids):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the drain did not apply every event within 10 s")
        assert await _registered(redis, prefix) == {"leaving"}
        assert await _consumers(redis, prefix, run_id) == {"leaving": 0}
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert await _consumers(redis, prefix, run_id) == {}
    assert await _registered(redis, prefix) == set()


async def test_consumers_without_heartbeats_are_deleted_once_idle_and_empty(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """Consumers of a drain from before heartbeats (or whose heartbeats were lost): the
    fallback claims their entries once idle for ``claim_idle_ms`` and then deletes them."""
    ids = await _run_with_events(redis, prefix, run_id)
    key = events_key(prefix, run_id)
    await EventStream(redis, prefix).ensure_group(run_id)
    skipped: set[StreamId] = set()  # acknowledged by their old consumer, here without applying
    for n in range(5):
        read = await redis.xreadgroup(CONSUMER_GROUP, f"old-{n}", {key: ">"}, count=2)
        if n % 2:
            await redis.xack(key, CONSUMER_GROUP, *[eid for eid, _ in read[0][1]])
            skipped.update(StreamId.parse(eid) for eid, _ in read[0][1])
    assert len(await _consumers(redis, prefix, run_id)) == 5

    live = make_ctx(consumer="live", claim_idle_ms=100)
    await _drain(live, claim=False)
    assert len(await _consumers(redis, prefix, run_id)) == 6  # none idle long enough yet
    await asyncio.sleep(0.1)
    counts = await _drain(live, claim=True)
    assert counts.consumers_deleted == 5
    assert await _consumers(redis, prefix, run_id) == {"live": 0}
    assert await _applied(sessionmaker, run_id) == {StreamId.parse(i) for i in ids} - skipped


async def test_a_consumer_holding_entries_is_never_deleted(
    redis: Redis, prefix: str, run_id: str
) -> None:
    """Deleting a consumer drops whatever it holds from the group's pending list: the check
    that it holds nothing and the deletion are one step."""
    await _run_with_events(redis, prefix, run_id, steps=5)
    stream = EventStream(redis, prefix)
    await stream.ensure_group(run_id)
    await stream.read_new([run_id], "holder", 2, None)
    assert await stream.delete_consumer(run_id, "holder") == -1
    assert await _consumers(redis, prefix, run_id) == {"holder": 2}
    assert await stream.delete_consumer(run_id, "nobody") == 0
    assert await stream.delete_consumer("no-such-run", "holder") == 0
    await redis.xadd(events_key(prefix, "no-group-yet"), {"e": "x"})
    assert await stream.delete_consumer("no-group-yet", "holder") == 0
    # Any other error is not "not in the group": it is raised, and the pass that met it fails.
    await redis.set(events_key(prefix, "not-a-stream"), "x")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await stream.delete_consumer("not-a-stream", "holder")
    await stream.ack(
        run_id,
        [
            p["message_id"]
            for p in await redis.xpending_range(
                events_key(prefix, run_id), CONSUMER_GROUP, "-", "+", 10, "holder"
            )
        ],
    )
    assert await stream.delete_consumer(run_id, "holder") == 1
    assert await _consumers(redis, prefix, run_id) == {}


async def test_a_consumer_that_leaves_holding_entries_is_taken_over(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """Stopped while it holds entries (its last commit failed): it stays in the group and keeps
    its last heartbeat, so that it is taken over once silent, not after ``claim_idle_ms``."""
    ids = await _run_with_events(redis, prefix, run_id, steps=5)
    leaving = make_ctx(consumer="leaving", heartbeat_timeout_ms=TIMEOUT_MS)
    assert await _crashed_holding(leaving, run_id, 2) == 2
    await leaving.drainer.leave()
    assert await _consumers(redis, prefix, run_id) == {"leaving": 2}
    assert await _registered(redis, prefix) == {"leaving"}

    await asyncio.sleep(TIMEOUT_MS / 1000)
    live = make_ctx(consumer="live", heartbeat_timeout_ms=TIMEOUT_MS)
    assert (await _drain(live)).taken_over == 2
    assert await _consumers(redis, prefix, run_id) == {"live": 0}
    assert await _applied(sessionmaker, run_id) == {StreamId.parse(i) for i in ids}


async def test_acks_a_failed_master_lost_are_made_again_after_the_failed_pass(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
    monkeypatch: Any,
) -> None:
    ids = await _run_with_events(redis, prefix, run_id)
    ctx = make_ctx(consumer="c")  # claim_idle_ms: the 30 s default, far away
    stream = ctx.drainer.stream

    async def lost(run_id: str, entry_ids: Any) -> int:
        return len(entry_ids)  # the master answered, then died before its replica had them

    with monkeypatch.context() as m:
        m.setattr(stream, "ack", lost)
        await _drain(ctx)
    applied = await _applied(sessionmaker, run_id)
    assert len(applied) == len(ids)
    assert (await _consumers(redis, prefix, run_id))["c"] == len(ids)

    async def down() -> list[str]:
        raise ConnectionError("Connection closed by server.")

    with monkeypatch.context() as m:  # the failover, as the drain sees it
        m.setattr(stream, "run_ids", down)
        try:
            await drain_once(ctx)
        except ConnectionError:
            pass
        else:
            raise AssertionError("the pass did not fail")
    await _drain(ctx)
    assert (await _consumers(redis, prefix, run_id))["c"] == 0
    assert await _applied(sessionmaker, run_id) == applied


async def test_acks_a_failed_master_lost_are_made_again_when_no_pass_failed(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
    monkeypatch: Any,
) -> None:
    """The same failover, with a Redis client that carries its commands over to the promoted
    replica rather than failing them (redis-py 8.2 retries with a backoff long enough to): no
    pass fails, and the drain still takes its own pending entries again within a heartbeat
    interval, long before the claim fallback (30 s) would."""
    ids = await _run_with_events(redis, prefix, run_id)
    ctx = make_ctx(consumer="c", heartbeat_timeout_ms=TIMEOUT_MS)
    stream = ctx.drainer.stream

    async def lost(run_id: str, entry_ids: Any) -> int:
        return len(entry_ids)

    everything = {StreamId.parse(i) for i in ids}
    with monkeypatch.context() as m:
        m.setattr(stream, "ack", lost)
        # Passes until every entry is applied. Its acks lost, each stays pending, and a pass
        # that starts a heartbeat interval after the last reads its own pending entries again
        # (already applied): on a busy machine every pass may, so "until a pass reads nothing"
        # need not come.
        for _ in range(50):
            await drain_once(ctx)
            if await _applied(sessionmaker, run_id) == everything:
                break
        else:
            raise AssertionError("not every entry applied after 50 passes")
    assert (await _consumers(redis, prefix, run_id))["c"] == len(ids)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10 * ctx.drainer.options.beat_s + 5.0
    while (await _consumers(redis, prefix, run_id))["c"]:
        assert loop.time() < deadline, "own pending entries not taken again"
        await drain_once(ctx, block_ms=10)  # a pass waits for new entries this long
    assert await _applied(sessionmaker, run_id) == {StreamId.parse(i) for i in ids}


@pytest.mark.parametrize("read", ["own pending", "claimable", "new"])
async def test_a_run_deleted_mid_read_is_one_log_line(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    caplog: pytest.LogCaptureFixture,
    read: str,
) -> None:
    """The run's stream goes between the pass's listing of the runs and its reads (as
    DELETE /v1/runs/{run_id} unlinks it), whichever read meets it first: the drain says so in
    one line, with no traceback, and goes on."""
    ctx = make_ctx(consumer="c", claim_idle_ms=0 if read == "claimable" else 60_000)
    if read == "own pending":
        await _run_with_events(redis, prefix, run_id)
        await _crashed_holding(ctx, run_id, 5)  # entries it read and must read again
    else:
        await _run_with_events(redis, prefix, run_id)
        await _drain(ctx)
        if read == "new":  # more to read (never read: the stream goes first)
            sim = RunSim(run_id, seed=8)
            sim.workload(3)
            await xadd_events(redis, prefix, run_id, sim.events)
    listed = ctx.drainer.stream.run_ids

    async def then_deleted() -> list[str]:
        run_ids = await listed()
        await redis.delete(events_key(prefix, run_id))
        return run_ids

    ctx.drainer.stream.run_ids = then_deleted  # type: ignore[method-assign]
    stop = asyncio.Event()
    with caplog.at_level(logging.DEBUG):
        await asyncio.wait_for(run_drain(ctx, stop, done=stop.set), timeout=30)
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.getMessage() for r in lines] == [
        f"run {run_id!r}: its event stream or consumer group is gone (the run was deleted "
        "meanwhile); the drain skips it"
    ]
    assert all(r.exc_info is None for r in caplog.records), "a traceback was logged"
