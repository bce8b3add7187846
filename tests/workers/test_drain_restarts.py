"""`rollout-broker worker` SIGKILLed while it holds events it has read and not applied, and
started again: the restarted worker takes over the dead one's events (its heartbeat stopped),
without waiting for the claim fallback, and the consumer group does not grow with the restarts
(issue 10, item 4). The fallback is set to ten minutes here, so catching up at all within a
minute shows the takeover; how many seconds it takes is printed, not asserted (a timing on a
shared machine), and is about the heartbeat timeout (3 s) plus the worker's start-up."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.accounting.stream import EventStream
from app.events import StreamId
from app.keys import CONSUMER_GROUP, drain_consumers_key, events_key
from tests.accounting.accounting_helpers import RunSim, entry, register_run
from tests.processes import Process, broker_env, worker_process
from tests.services import REDIS_URL

RESTARTS = 3
CLAIM_FALLBACK_MS = 600_000  # far beyond any wait below: only the takeover can catch up


@pytest.mark.slow
async def test_a_killed_worker_is_caught_up_within_seconds_of_its_restart(
    redis: Redis,
    prefix: str,
    database_url: str,
    sessionmaker: async_sessionmaker[AsyncSession],
    tmp_path: Path,
) -> None:
    run_id = f"restarts-{prefix}"
    sim = RunSim(run_id, seed=31)
    sim.workload(120)
    await register_run(redis, prefix, run_id)
    key = events_key(prefix, run_id)
    stream = EventStream(redis, prefix)
    events = list(sim.events)
    produced: list[bytes] = []

    async def produce(n: int) -> None:
        chunk, events[:n] = events[:n], []
        assert chunk, "workload too small"
        async with redis.pipeline(transaction=False) as pipe:
            for event_type, payload in chunk:
                pipe.xadd(key, entry(event_type, payload))
            produced.extend(await pipe.execute())

    async def caught_up() -> bool:
        async with sessionmaker() as s:
            applied = await repository.processed_ids(s, run_id)
        done = applied == {StreamId.parse(i) for i in produced}
        return done and await stream.pending_events(run_id) == 0

    async def wait_caught_up(within: float) -> float:
        start = time.monotonic()
        while not await caught_up():
            assert time.monotonic() - start < within, (tmp_path / "worker.log").read_text()
            await asyncio.sleep(0.02)
        return time.monotonic()

    async def group() -> set[str]:
        return {r["name"].decode() for r in await redis.xinfo_consumers(key, CONSUMER_GROUP)}

    async def consumer_of(worker: Process) -> str:
        """The worker's consumer (named host-pid-random), once it has read from the group."""
        assert worker.proc is not None
        mark = f"-{worker.proc.pid}-"
        for _ in range(250):
            if mine := [n for n in await group() if mark in n]:
                return mine[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"worker {worker.proc.pid} is not in the group: {await group()}")

    async def held_by(consumer: str) -> int:
        rows = await redis.xpending_range(key, CONSUMER_GROUP, "-", "+", 100, consumer)
        return len(rows)

    env = broker_env(
        BROKER_REDIS_URL=REDIS_URL,
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_DRAIN_CLAIM_IDLE_MS=str(CLAIM_FALLBACK_MS),
    )
    worker = worker_process(env, tmp_path / "worker.log")
    await produce(20)
    await worker.start()
    try:
        await wait_caught_up(30)
        figures = []
        for _ in range(RESTARTS):
            consumer = await consumer_of(worker)
            # Killed holding events: stopped while it blocks on XREADGROUP, it is handed the
            # next events by Redis all the same. If it was between two reads, let it go on.
            assert worker.proc is not None
            for _attempt in range(20):
                worker.proc.send_signal(signal.SIGSTOP)
                await produce(4)
                await asyncio.sleep(0.05)
                if await held_by(consumer):
                    break
                worker.proc.send_signal(signal.SIGCONT)
                await wait_caught_up(10)
            held = await held_by(consumer)
            assert held > 0
            await worker.kill()
            killed = time.monotonic()
            await produce(4)  # and more while it is down
            await worker.start()
            started = time.monotonic()
            done = await wait_caught_up(60)
            figures.append((held, done - started, done - killed))
        print(  # the figures for the record (pytest -s)
            "held, caught up after restart (s), after kill (s):",
            [(h, round(a, 2), round(b, 2)) for h, a, b in figures],
        )

        # The group keeps the live worker only: every killed one was deleted.
        alive = await consumer_of(worker)
        deadline = time.monotonic() + 5
        while await group() != {alive}:
            assert time.monotonic() < deadline, await group()
            await asyncio.sleep(0.05)
        assert {n.decode() for n in await redis.zrange(drain_consumers_key(prefix), 0, -1)} == {
            alive
        }
    finally:
        await worker.stop()  # SIGTERM: it leaves the group
    assert worker.proc is not None and worker.proc.returncode == 0
    assert await group() == set()
    assert await redis.zcard(drain_consumers_key(prefix)) == 0
