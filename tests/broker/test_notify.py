"""Wake-ups: a script that makes units ready publishes while a trainer waits on the run, and a
waiter's event is set by it. Only a pub/sub message sets an event (the once-a-second re-check
lives in the lease loop, not here), so the generous timeouts below cannot let a missing publish
pass. Whether a publish was sent is told by a marker published after it on the same channel:
pub/sub delivers in order."""

from __future__ import annotations

import asyncio
import uuid

from app import keys
from app.broker.config import RunConfig
from app.broker.notify import Ticket, Waker
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


async def nothing_published_before(
    waker: Waker, redis, store: RedisStore, run_id: str = "r"
) -> None:  # type: ignore[no-untyped-def]
    """Returns once whatever was published on ``run_id``'s channel before has reached ``waker``:
    a marker published after it on the same channel has."""
    with waker.line("marker") as marker:
        await joined(waker, marker)
        await redis.spublish(
            keys.wake_channel(store.prefix, run_id), keys.run_tag(store.prefix, "marker")
        )
        await asyncio.wait_for(marker.event.wait(), timeout=5)


async def joined(waker: Waker, *tickets: Ticket) -> None:
    """What a long poll does before its first try: until the tickets' runs are subscribed."""
    for ticket in tickets:
        await waker.listening(ticket)


async def test_ingest_wakes_the_waiters_of_its_run_only(store, redis):
    waker = Waker(redis, store.prefix)
    await waker.start()
    try:
        await store.create_run("r", RunConfig())
        await store.create_run("other", RunConfig())
        await start_waiting(store, "r")
        await start_waiting(store, "other")
        with waker.line("r") as mine, waker.line("other") as theirs:
            await joined(waker, mine, theirs)
            await store.ingest("r", [packed("a")])
            await asyncio.wait_for(mine.event.wait(), timeout=5)
            assert not theirs.event.is_set()
            waker.trying(mine)
            assert not mine.event.is_set()  # the next wait needs the next wake-up
    finally:
        await waker.stop()


async def test_an_open_group_wakes_nobody_until_it_completes(store, redis):
    waker = Waker(redis, store.prefix)
    await waker.start()
    try:
        await store.create_run("r", RunConfig(group_size=2))
        await start_waiting(store, "r", size=2)
        with waker.line("r", size=2) as ticket:
            await joined(waker, ticket)
            await store.ingest("r", [packed("a", group="g")])
            await nothing_published_before(waker, redis, store)
            assert not ticket.event.is_set()
            await store.ingest("r", [packed("b", group="g")])
            await asyncio.wait_for(ticket.event.wait(), timeout=5)
    finally:
        await waker.stop()


async def test_no_wake_up_is_sent_while_nobody_waits(store, redis):
    """Every API process receives every wake-up: with no trainer long-polling the run, ingest
    publishes nothing; once one waits, it does."""
    waker = Waker(redis, store.prefix)
    await waker.start()
    try:
        await store.create_run("r", RunConfig())
        with waker.line("r") as ticket:
            await joined(waker, ticket)
            await store.ingest("r", [packed("a")])
            await nothing_published_before(waker, redis, store)
            assert not ticket.event.is_set()
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
            await asyncio.wait_for(ticket.event.wait(), timeout=5)
    finally:
        await waker.stop()


# -- the line: who a wake-up reaches ----------------------------------------------------------
def woken(*tickets: Ticket) -> list[bool]:
    return [t.event.is_set() for t in tickets]


async def test_a_wake_up_reaches_the_first_waiter_not_woken_yet(redis):
    waker = Waker(redis, "rb")
    with waker.line("r") as a, waker.line("r") as b, waker.line("r") as c:
        waker.wake("r")
        assert woken(a, b, c) == [True, False, False]
        waker.wake("r")  # a second one while the first is unused: the next waiter
        assert woken(a, b, c) == [True, True, False]
        with waker.line("other") as elsewhere:
            waker.wake("r")
            assert woken(a, b, c, elsewhere) == [True, True, True, False]


async def test_a_served_waiter_passes_the_wake_up_on_and_a_short_one_only_to_whom_it_can_serve(
    redis,
):
    waker = Waker(redis, "rb")
    with (
        waker.line("r", size=8) as big,
        waker.line("r", size=4) as mid,
        waker.line("r", size=1) as one,
    ):
        waker.wake("r")
        waker.trying(big)
        waker.short(big, 2)  # found 2: only the waiter asking for 1 can use them
        assert woken(big, mid, one) == [False, False, True]
        waker.trying(one)
        waker.served(one)  # more may be ready: the next waiter not woken tries
        assert woken(big, mid, one) == [True, False, False]
        waker.trying(big)
        waker.short(big, 0)  # found nothing: nobody else is woken for it
        assert woken(big, mid, one) == [False, False, False]


async def test_a_waiter_leaving_with_an_unused_wake_up_passes_it_on(redis):
    waker = Waker(redis, "rb")
    with waker.line("r") as stays:
        with waker.line("r") as leaves:
            waker.wake("r")
            waker.wake("r")
            waker.trying(stays)  # stays used its wake-up; leaves got one it will not use
            assert woken(stays, leaves) == [False, True]
        assert woken(stays) == [True]
        assert waker.waiting("r") == 1
    assert waker.waiting("r") == 0


async def test_a_version_change_wakes_every_follower_of_its_run_and_only_while_one_waits(
    store, redis
):
    waker = Waker(redis, store.prefix)
    await waker.start()
    try:
        await store.create_run("r", RunConfig())
        kind = keys.POLICY_WAKE
        with waker.line("r", kind) as a, waker.line("r", kind) as b, waker.line("r") as trainer:
            await joined(waker, a, b, trainer)
            await store.set_policy("r", 1)  # nobody follows the version yet: nothing is sent
            await nothing_published_before(waker, redis, store)
            assert woken(a, b, trainer) == [False, False, False]
            # A read of a version other than after does not wait, and asks for no wake-up.
            assert (await store.policy("r", after=0, wait_ms=10_000)).policy_version == 1
            await store.set_policy("r", 2)
            await nothing_published_before(waker, redis, store)
            assert woken(a, b, trainer) == [False, False, False]
            # A follower with the current version is about to wait: the next change wakes
            # every follower of the run at once, and no trainer.
            assert (await store.policy("r", after=2, wait_ms=10_000)).policy_version == 2
            await store.set_policy("r", 2)  # the same version: nothing moved
            await nothing_published_before(waker, redis, store)
            assert woken(a, b, trainer) == [False, False, False]
            await store.set_policy("r", 3, weights="ckpt/3")
            await asyncio.wait_for(b.event.wait(), timeout=5)
            assert woken(a, b, trainer) == [True, True, False]
    finally:
        await waker.stop()
