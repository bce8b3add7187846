"""Wake-ups: a script that makes units ready publishes while a trainer waits on the run, and a
waiter's event is set by it. Only a pub/sub message sets an event (the once-a-second re-check
lives in the lease loop, not here), so the generous timeouts below cannot let a missing publish
pass. Whether a publish was sent is told by a marker published after it on the same channel:
pub/sub delivers in order."""

from __future__ import annotations

import asyncio
import uuid

from app.broker import keys
from app.broker.config import RunConfig
from app.broker.notify import Waker
from app.broker.store import RedisStore
from tests.broker.test_store import packed


async def start_waiting(store: RedisStore, run_id: str, size: int = 1) -> None:
    """What a long-polling lease does first: a lease call that finds too little, and says it
    will wait."""
    got = await store.lease(
        run_id,
        batch_id=uuid.uuid4().hex,
        size=size,
        policy_version=None,
        partial=False,
        trainer_id=None,
        wait_ms=10_000,
    )
    assert got == 0


async def nothing_published_before(waker: Waker, redis, store: RedisStore) -> None:  # type: ignore[no-untyped-def]
    marker = waker.event("marker")
    await redis.publish(store.wake_channel, keys.run_tag(store.prefix, "marker"))
    await asyncio.wait_for(marker.wait(), timeout=5)


async def test_ingest_wakes_the_waiters_of_its_run_only(store, redis):
    waker = Waker(redis, store.wake_channel, store.prefix)
    await waker.start()
    try:
        await store.create_run("r", RunConfig())
        await store.create_run("other", RunConfig())
        await start_waiting(store, "r")
        await start_waiting(store, "other")
        mine, theirs = waker.event("r"), waker.event("other")
        await store.ingest("r", [packed("a")])
        await asyncio.wait_for(mine.wait(), timeout=5)
        assert not theirs.is_set()
        assert waker.event("r") is not mine  # the next wait needs the next wake-up
    finally:
        await waker.stop()


async def test_an_open_group_wakes_nobody_until_it_completes(store, redis):
    waker = Waker(redis, store.wake_channel, store.prefix)
    await waker.start()
    try:
        await store.create_run("r", RunConfig(group_size=2))
        await start_waiting(store, "r", size=2)
        ev = waker.event("r")
        await store.ingest("r", [packed("a", group="g")])
        await nothing_published_before(waker, redis, store)
        assert not ev.is_set()
        await store.ingest("r", [packed("b", group="g")])
        await asyncio.wait_for(ev.wait(), timeout=5)
    finally:
        await waker.stop()


async def test_no_wake_up_is_sent_while_nobody_waits(store, redis):
    """Every API process receives every wake-up: with no trainer long-polling the run, ingest
    publishes nothing; once one waits, it does."""
    waker = Waker(redis, store.wake_channel, store.prefix)
    await waker.start()
    try:
        await store.create_run("r", RunConfig())
        ev = waker.event("r")
        await store.ingest("r", [packed("a")])
        await nothing_published_before(waker, redis, store)
        assert not ev.is_set()
        await store.lease(  # a lease that takes what there is does not wait
            "r",
            batch_id=uuid.uuid4().hex,
            size=1,
            policy_version=None,
            partial=False,
            trainer_id=None,
        )
        await start_waiting(store, "r")
        await store.ingest("r", [packed("b")])
        await asyncio.wait_for(ev.wait(), timeout=5)
    finally:
        await waker.stop()
