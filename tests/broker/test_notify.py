"""Wake-ups: a script that makes units ready publishes while a trainer waits on the run, and a
waiter's event is set by it. Only a pub/sub message sets an event (the once-a-second re-check
lives in the lease loop, not here), so the generous timeouts below cannot let a missing publish
pass. Whether a publish was sent is told by a marker published after it on the same channel:
pub/sub delivers in order."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from app import keys
from app.broker.config import RunConfig
from app.broker.notify import Ticket, Try, Waker, long_poll
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


# -- one shard channel per run ------------------------------------------------------------------
def node_of(redis, channel: str):  # type: ignore[no-untyped-def]
    """Where ``channel`` lives: its slot's master on a cluster (None on one node)."""
    return redis.get_node_from_key(channel) if isinstance(redis, RedisCluster) else None


async def subscribers(redis, channel: str) -> int:  # type: ignore[no-untyped-def]
    """``PUBSUB SHARDNUMSUB``, asked of the node that holds the channel's slot."""
    node = node_of(redis, channel)
    direct = Redis(host=node.host, port=node.port) if node is not None else redis
    try:
        reply = await direct.execute_command("PUBSUB", "SHARDNUMSUB", channel)
    finally:
        if direct is not redis:
            await direct.aclose()
    return int(reply[1])


def runs_on_two_nodes(redis, prefix: str) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """Two run ids whose slots are on different masters of a cluster (any two on one node)."""
    first = "run-a"
    where = node_of(redis, keys.wake_channel(prefix, first))
    for i in range(1000):
        other = f"run-b{i}"
        if where is None or node_of(redis, keys.wake_channel(prefix, other)) != where:
            return first, other
    raise AssertionError("no two runs on different nodes")


async def test_a_wake_up_stays_on_its_runs_channel_and_wakes_only_that_runs_waiters(store, redis):
    """Runs A and B on different masters of a cluster: a wake-up of A, published on A's shard
    channel, reaches A's waiter and not B's, and then B's reaches B's."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()
    a, b = runs_on_two_nodes(redis, store.prefix)
    waker = Waker(redis, store.prefix)
    await waker.start()
    try:
        for run in (a, b):
            await store.create_run(run, RunConfig())
            await start_waiting(store, run)
        with waker.line(a) as mine, waker.line(b) as theirs:
            await joined(waker, mine, theirs)
            assert waker.subscribed() == {a, b}
            for run in (a, b):
                assert await subscribers(redis, keys.wake_channel(store.prefix, run)) == 1
            await store.ingest(a, [packed("x")])
            await asyncio.wait_for(mine.event.wait(), timeout=5)
            await nothing_published_before(waker, redis, store, b)
            assert woken(mine, theirs) == [True, False]
            await store.ingest(b, [packed("y")])
            await asyncio.wait_for(theirs.event.wait(), timeout=5)
    finally:
        await waker.stop()


async def test_a_runs_subscription_is_dropped_once_its_last_waiter_left(store, redis):
    """Held while any waiter of the run is in line in this process, whatever its kind; dropped
    (SUNSUBSCRIBE) once the last one left and the linger is over; a new waiter subscribes
    again, and is woken."""
    waker = Waker(redis, store.prefix, linger_s=0.2)
    await waker.start()
    channel = keys.wake_channel(store.prefix, "r")
    try:
        await store.create_run("r", RunConfig())
        with waker.line("r") as trainer:
            with waker.line("r", keys.WORK_WAKE) as generator:
                await joined(waker, trainer, generator)
                assert await subscribers(redis, channel) == 1
            await asyncio.sleep(0.5)  # past the linger: the trainer still holds it
            assert await subscribers(redis, channel) == 1
            assert waker.subscribed() == {"r"}
        deadline = asyncio.get_running_loop().time() + 5
        while await subscribers(redis, channel) != 0:
            assert asyncio.get_running_loop().time() < deadline, "still subscribed"
            await asyncio.sleep(0.05)
        assert waker.subscribed() == set()
        await start_waiting(store, "r")
        with waker.line("r") as again:
            await joined(waker, again)
            assert await subscribers(redis, channel) == 1
            await store.ingest("r", [packed("a")])
            await asyncio.wait_for(again.event.wait(), timeout=5)
    finally:
        await waker.stop()


async def kill_subscriber_connections(redis, name: str) -> int:  # type: ignore[no-untyped-def]
    """CLIENT KILL every connection named ``name`` with a shard channel, on every master; how
    many."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()
        nodes = [Redis(host=n.host, port=n.port) for n in redis.get_primaries()]
    else:
        nodes = [redis]
    killed = 0
    try:
        for node in nodes:
            for client in await node.client_list():
                if client.get("name") == name and client.get("ssub", "0") != "0":
                    await node.execute_command("CLIENT", "KILL", "ID", client["id"])
                    killed += 1
    finally:
        for node in nodes:
            if node is not redis:
                await node.aclose()
    return killed


async def test_a_waiter_whose_subscription_drops_is_told_to_recheck_and_woken_again(
    store, redis_backend
):
    """The connection carrying a run's subscription is killed: its waiter is woken at once to
    re-check (a wake-up may have been lost meanwhile), not only at the fallback re-check, and
    the subscription comes back: the next wake-up reaches it."""
    name = f"waker-{uuid.uuid4().hex[:8]}"
    if redis_backend.cluster:
        redis = RedisCluster.from_url(redis_backend.url, client_name=name)
    else:
        redis = Redis.from_url(redis_backend.url, client_name=name)
    waker = Waker(redis, store.prefix, fallback_s=3600)
    await waker.start()
    channel = keys.wake_channel(store.prefix, "r")
    try:
        await store.create_run("r", RunConfig())
        await start_waiting(store, "r")
        with waker.line("r") as ticket:
            await joined(waker, ticket)
            assert await kill_subscriber_connections(store.redis, name) == 1
            await asyncio.wait_for(ticket.event.wait(), timeout=10)
            waker.trying(ticket)
            deadline = asyncio.get_running_loop().time() + 10
            while await subscribers(store.redis, channel) != 1:
                assert asyncio.get_running_loop().time() < deadline, "not subscribed again"
                await asyncio.sleep(0.05)
            await store.ingest("r", [packed("a")])
            await asyncio.wait_for(ticket.event.wait(), timeout=5)
    finally:
        await waker.stop()
        await redis.aclose()


async def test_a_cancelled_long_poll_ends_at_once_not_after_its_wait(redis):
    """A request cancelled while it waits for a wake-up (its client gone, the server shutting
    down) ends with the cancellation, even when a wake-up comes in the same instant: Python
    3.11's ``asyncio.wait_for`` returned then as if no cancellation had come, and the poll
    tried again and waited out its ``wait_s``."""
    waker = Waker(redis, "rb", fallback_s=60.0)
    tried = asyncio.Event()

    async def attempt(_: Try) -> tuple[None, int]:
        tried.set()
        return None, 0  # nothing found: the poll waits

    poll = asyncio.create_task(long_poll(waker, "r", "", 1, 2.0, attempt))
    await tried.wait()
    await asyncio.sleep(0)  # into its wait
    waker.wake("r")  # a wake-up that lands with the cancellation must not undo it
    poll.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await poll
    assert poll.cancelled()
