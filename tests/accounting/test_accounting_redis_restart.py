"""Redis restarted under a running drain (AOF, fsync always): nothing Redis acknowledged to
the producer may be missing from the accounting afterwards. On one node of the tests' own: a
cluster node restarted under traffic is the chaos test's and the failover test's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from accounting_helpers import RunSim, assert_matches, build_app, entry, register_run
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.accounting.drain import DrainOptions
from app.accounting.stream import EventStream
from app.broker.config import RunConfig
from app.broker.schemas import AckBody, RolloutJSON
from app.events import StreamId
from app.keys import events_key
from app.settings import Settings
from tests.helpers import OPS
from tests.processes import RedisServer
from workers.drain import DrainContext, run_drain
from workers.runner import broker_for


@pytest_asyncio.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[RedisServer]:
    server = RedisServer(tmp_path)
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


async def _wait_for(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.one_node
async def test_redis_restart_loses_nothing_acknowledged(
    own_redis: RedisServer,
    prefix: str,
    run_id: str,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    sim = RunSim(run_id, seed=31, group_size=2)
    sim.workload(90)
    events = list(sim.events)
    # The producer retries itself (below); redis-py's own retries would hide which attempt
    # landed.
    producer_client = Redis(port=own_redis.port, retry=Retry(NoBackoff(), 0))
    drain_client = Redis(port=own_redis.port, decode_responses=False)
    await register_run(producer_client, prefix, run_id)
    key = events_key(prefix, run_id)
    acknowledged: list[bytes] = []
    ambiguous = 0

    async def produce(upto: int) -> None:
        """XADD with explicit ids, retrying through outages: a retry of an XADD whose reply
        was lost fails with "equal or smaller", which proves the first attempt landed."""
        nonlocal ambiguous
        while len(acknowledged) < upto:
            n = len(acknowledged)
            entry_id = f"1-{n + 1}"
            event_type, payload = events[n]
            retried = False
            while True:
                try:
                    acknowledged.append(
                        await producer_client.xadd(key, entry(event_type, payload), id=entry_id)
                    )
                    break
                except (RedisConnectionError, OSError):
                    retried = True
                    await asyncio.sleep(0.02)  # the server is restarting
                except ResponseError as exc:
                    if retried and "equal or smaller" in str(exc):
                        ambiguous += 1
                        acknowledged.append(entry_id.encode())
                        break
                    raise
            if n % 4 == 0:
                await asyncio.sleep(0.002)  # let the drain interleave

    async def applied() -> set[StreamId]:
        async with sessionmaker() as s:
            return await repository.processed_ids(s, run_id)

    ctx = DrainContext.create(
        drain_client,
        sessionmaker,
        prefix,
        DrainOptions(block_ms=50, claim_idle_ms=200, batch_size=16),
    )
    stop = asyncio.Event()
    drain = asyncio.create_task(run_drain(ctx, stop))
    third = len(events) // 3
    try:
        await produce(third)
        await _wait_for(lambda: _has(applied, 1), 20, "the first events to drain")

        # 1. SHUTDOWN while the producer and the drain are both running.
        producing = asyncio.create_task(produce(2 * third))
        await asyncio.sleep(0.1)
        await own_redis.shutdown()
        await own_redis.start()
        await producing

        # 2. SIGKILL: with appendfsync always, every acknowledged write is already on disk.
        producing = asyncio.create_task(produce(len(events)))
        await asyncio.sleep(0.1)
        await own_redis.kill()
        await own_redis.start()
        await producing

        want = {StreamId.parse(i) for i in acknowledged}

        async def caught_up() -> bool:
            return await applied() == want and await ctx.drainer.stream.pending_events(run_id) == 0

        await _wait_for(caught_up, 30, "the drain to catch up after the restarts")
    finally:
        stop.set()
        await asyncio.wait_for(drain, 10)

    assert len(acknowledged) == len(events)
    # The stream survived both restarts as a whole: each acknowledged entry exactly once.
    assert await applied() == {StreamId.parse(i) for i in acknowledged}
    app = build_app(sessionmaker, drain_client, prefix)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as api:
        body = (await api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert_matches(body, sim.expected())

    # pending_events counts entries that no consumer has read yet (Redis 6.2 has no group lag).
    stream = EventStream(drain_client, prefix)
    extra = RunSim(run_id, seed=32)
    extra.ingest(2)
    for event_type, payload in extra.events:
        await drain_client.xadd(key, entry(event_type, payload))
    assert await stream.pending_events(run_id) == len(extra.events)
    await producer_client.aclose()
    await drain_client.aclose()


async def _has(applied: Callable[[], Awaitable[set[StreamId]]], n: int) -> bool:
    return len(await applied()) >= n


@pytest.mark.slow
@pytest.mark.one_node
async def test_broker_changes_answered_before_a_restart_are_all_accounted(
    own_redis: RedisServer,
    prefix: str,
    run_id: str,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """The broker's own scripts against a Redis that is shut down and then killed between its
    calls: every ingest, lease and ack the clients were answered survives in the AOF, the
    scripts are loaded again on the new server (EVALSHA → NOSCRIPT → reload), and the drain
    resumes, so the accounting equals what the clients were told."""
    settings = Settings(redis_url="redis://unused", redis_prefix=prefix, database_url=None)
    client = Redis(port=own_redis.port)
    broker = broker_for(client, settings)
    ctx = DrainContext.create(
        Redis(port=own_redis.port),
        sessionmaker,
        prefix,
        DrainOptions(block_ms=50, claim_idle_ms=200, batch_size=16),
    )
    stop = asyncio.Event()
    drain = asyncio.create_task(run_drain(ctx, stop))
    await broker.create_run(run_id, RunConfig(max_reuse=2, kl_max=10.0, kl_flush=10.0), OPS)
    received = consumed = batches = 0
    try:
        for round_, restart in enumerate((own_redis.shutdown, own_redis.kill, None)):
            posted = await broker.ingest_packed(
                run_id,
                broker.pack(
                    [
                        RolloutJSON(
                            rollout_id=f"{round_}-{i}",
                            policy_version=0,
                            response_ids=[1, 2, 3],
                            logprobs=[-0.5, -0.6, -0.7],
                            reward=float(i % 2),
                        )
                        for i in range(20)
                    ]
                ),
            )
            received += posted.accepted
            batch = await broker.lease(
                run_id, size=8, policy_version=None, wait_s=0, partial=False, trainer_id="t"
            )
            assert batch is not None
            current = {r.rollout_id: [-0.5, -0.6, -0.8] for r, *_ in batch.rollouts}
            answer = await broker.training.ack(run_id, batch.batch_id, AckBody(logprobs=current))
            consumed += answer.consumed
            batches += 1
            if restart is not None:
                await restart()
                await own_redis.start()
                await ctx.drainer.stream.redis.ping()  # the drain's connection comes back too

        async def caught_up() -> bool:
            return await ctx.drainer.stream.pending_events(run_id) == 0

        await _wait_for(caught_up, 30, "the drain to catch up after the restarts")
    finally:
        stop.set()
        await asyncio.wait_for(drain, 10)

    app = build_app(sessionmaker, client, prefix)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as api:
        body = (await api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert (received, consumed, batches) == (60, 24, 3)
    assert body["pending_events"] == 0
    assert body["rollouts_received"] == received
    assert body["samples_consumed"] == consumed
    assert body["batches"]["acked"] == batches
    assert body["buffered"] + body["leased"] + sum(body["retired"].values()) == received
    assert body["kl"]["max"] is not None  # the acks' measured KL reached Postgres too
    await client.aclose()
    await ctx.drainer.stream.redis.aclose()
