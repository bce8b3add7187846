"""Crash safety: `rollout-broker worker` as a subprocess, SIGKILLed over and over while a producer
appends events, including between its Postgres commit and its XACK."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from accounting_helpers import RunSim, assert_matches, entry, register_run
from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.accounting.models import ProcessedEvent
from app.events import StreamId
from app.keys import CONSUMER_GROUP, events_key
from tests.crashing_worker import CRASH_EXIT_CODE
from tests.services import RedisBackend

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 10  # a worker started and killed in each; every fourth dies between commit and XACK


async def _applied(sm: async_sessionmaker[AsyncSession], run_ids: list[str]) -> int:
    async with sm() as s:
        n = await s.scalar(
            select(func.count())
            .select_from(ProcessedEvent)
            .where(ProcessedEvent.run_id.in_(run_ids))
        )
    return int(n or 0)


async def _wait_for(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _pending_applied(
    redis: Redis,
    sm: async_sessionmaker[AsyncSession],
    prefix: str,
    run_ids: list[str],
    consumer: str,
) -> int:
    """Entries pending at ``consumer`` that are already applied in Postgres: the evidence that
    the consumer died after its commit and before its XACK."""
    total = 0
    for run_id in run_ids:
        pending = await redis.xpending_range(
            events_key(prefix, run_id), CONSUMER_GROUP, "-", "+", 10_000, consumername=consumer
        )
        async with sm() as s:
            applied = await repository.processed_ids(s, run_id)
        total += sum(StreamId.parse(p["message_id"]) in applied for p in pending)
    return total


def _log(
    tmp_path: Path, proc: subprocess.Popen[bytes], procs: list[subprocess.Popen[bytes]]
) -> str:
    return (tmp_path / f"worker-{procs.index(proc)}.log").read_text()[-3000:]


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    """Never leave a worker behind, whatever failed."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
async def test_sigkill_many_times_loses_and_doubles_nothing(
    redis: Redis,
    redis_backend: RedisBackend,
    prefix: str,
    database_url: str,
    sessionmaker: async_sessionmaker[AsyncSession],
    accounting_api: httpx.AsyncClient,
    tmp_path: Path,
) -> None:
    rng = random.Random(20)
    sims = [
        RunSim(f"crash-a-{prefix}", seed=21, lua=True),
        RunSim(f"crash-b-{prefix}", seed=22, group_size=3, lua=False),
    ]
    for n, sim in enumerate(sims):
        sim.workload(120)
        await register_run(redis, prefix, sim.run_id, n)
    run_ids = [s.run_id for s in sims]
    total = sum(len(s.events) for s in sims)
    produced: dict[str, list[bytes]] = {s.run_id: [] for s in sims}

    queues = [(s.run_id, list(s.events)) for s in sims]
    lock = asyncio.Lock()
    hurry = asyncio.Event()

    async def produce_chunk(size: int) -> int:
        """XADD the next ``size`` events of each run, in order, as one pipeline per run."""
        n = 0
        async with lock:
            for run_id, queue in queues:
                chunk, queue[:] = queue[:size], queue[size:]
                if not chunk:
                    continue
                async with redis.pipeline(transaction=False) as pipe:
                    for event_type, payload in chunk:
                        pipe.xadd(events_key(prefix, run_id), entry(event_type, payload))
                    produced[run_id].extend(await pipe.execute())
                n += len(chunk)
        return n

    # Events held back for the crash-after-commit rounds, so those always have work.
    reserve = len(range(1, ROUNDS, 4)) * 30

    async def produce() -> None:
        # Paced so that production goes on during the kills; the reserve once told to hurry.
        while True:
            if not hurry.is_set() and min(len(q) for _, q in queues) <= reserve:
                await asyncio.sleep(0.03)
                continue
            if not await produce_chunk(3):
                return
            if not hurry.is_set():
                await asyncio.sleep(0.04)

    env = {
        **os.environ,
        **redis_backend.env(),
        "BROKER_DATABASE_URL": database_url,
        "BROKER_REDIS_PREFIX": prefix,
        "BROKER_DRAIN_CLAIM_IDLE_MS": "150",
        "BROKER_DRAIN_BLOCK_MS": "50",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("BROKER_DRAIN_CONSUMER", None)

    spawned: list[subprocess.Popen[bytes]] = []

    def spawn(crash_after: int | None = None, **extra: str) -> subprocess.Popen[bytes]:
        # `rollout-broker worker`, or the same exiting after `crash_after` commits
        command = ["app.cli", "worker"]
        if crash_after is not None:
            command = ["tests.crashing_worker", str(crash_after)]
        # Logs go to a file: a pipe nobody reads could fill up and stall the worker.
        with (tmp_path / f"worker-{len(spawned)}.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", *command],
                cwd=REPO,
                env={**env, "BROKER_DRAIN_BATCH_SIZE": str(rng.randint(3, 40)), **extra},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        spawned.append(proc)
        return proc

    producer = asyncio.create_task(produce())
    kills = window_crashes = 0
    try:
        for round_no in range(ROUNDS):
            if round_no % 4 == 1:
                # Die right after a commit, before the XACK (with work to do, so it commits).
                assert await produce_chunk(30) > 0, "workload too small for the kill rounds"
                consumer = f"crashing-{round_no}"
                proc = spawn(crash_after=rng.randint(1, 3), BROKER_DRAIN_CONSUMER=consumer)
                await asyncio.to_thread(proc.wait, 60)
                assert proc.returncode == CRASH_EXIT_CODE, _log(tmp_path, proc, spawned)
                # Its last batch is in Postgres and still pending in Redis.
                assert await _pending_applied(redis, sessionmaker, prefix, run_ids, consumer) > 0
                window_crashes += 1
                continue
            proc = spawn()
            before = await _applied(sessionmaker, run_ids)
            backlog = sum(len(v) for v in produced.values()) - before
            if round_no % 2 == 0 and backlog > 0:
                # Kill while it is working: after it has applied something.
                async def progressed(
                    before: int = before, proc: subprocess.Popen[bytes] = proc
                ) -> bool:
                    applied = await _applied(sessionmaker, run_ids)
                    return applied > before or proc.poll() is not None

                await _wait_for(progressed, 30, "the worker to apply events")
                await asyncio.sleep(rng.uniform(0, 0.3))
            else:
                await asyncio.sleep(rng.uniform(0.3, 1.6))  # anywhere, start-up included
            assert proc.poll() is None, _log(tmp_path, proc, spawned)
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 10)
            assert proc.returncode == -signal.SIGKILL
            kills += 1
        hurry.set()
        await producer
    finally:
        if not producer.done():
            producer.cancel()
        _reap(spawned)

    assert kills >= 7 and window_crashes >= 3
    assert sum(len(v) for v in produced.values()) == total

    # A last worker, left alone, catches up; then stops cleanly on SIGTERM.
    proc = spawn()
    try:

        async def caught_up() -> bool:
            if await _applied(sessionmaker, run_ids) < total:
                return False
            for run_id in run_ids:
                key = events_key(prefix, run_id)
                if (await redis.xpending(key, CONSUMER_GROUP))["pending"] or await redis.xlen(key):
                    return False
            return True

        await _wait_for(caught_up, 60, "the last worker to drain and trim everything")
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 20)
        assert proc.returncode == 0, _log(tmp_path, proc, spawned)
    finally:
        _reap(spawned)

    for sim in sims:
        async with sessionmaker() as s:
            applied = await repository.processed_ids(s, sim.run_id)
        assert applied == {StreamId.parse(i) for i in produced[sim.run_id]}
        body = (await accounting_api.get(f"/v1/runs/{sim.run_id}/accounting")).json()
        assert_matches(body, sim.expected())
        assert body["pending_events"] == 0
