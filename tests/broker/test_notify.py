"""Wake-ups: a script that makes units ready publishes, and a waiter's event is set by it.
Only a pub/sub message sets an event (the once-a-second re-check lives in the lease loop, not
here), so the generous timeouts below cannot let a missing publish pass."""

from __future__ import annotations

import asyncio

from app.broker.config import RunConfig
from app.broker.notify import Waker
from tests.broker.test_store import packed


async def test_ingest_wakes_the_waiters_of_its_run_only(store, redis):
    waker = Waker(redis, store.wake_channel, store.prefix)
    await waker.start()
    try:
        await store.create_run("r", RunConfig())
        await store.create_run("other", RunConfig())
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
        ev = waker.event("r")
        await store.ingest("r", [packed("a", group="g")])
        # A marker publish on the same connection order proves the ingest's publish (if any)
        # was delivered before it.
        marker = waker.event("marker")
        await redis.publish(store.wake_channel, f"{store.prefix}:{{marker}}")
        await asyncio.wait_for(marker.wait(), timeout=5)
        assert not ev.is_set()
        await store.ingest("r", [packed("b", group="g")])
        await asyncio.wait_for(ev.wait(), timeout=5)
    finally:
        await waker.stop()
