"""Consumers of kind rollouts in Redis (SPEC "Consumers", docs/design.md "Consumers (Redis
core)"): the registry, delivery at reward (received) and at first gradient (trained), leases,
retention, the blobs kept while a consumer holds a rollout, and a policy trainer that sees the
same run with and without consumers."""

from __future__ import annotations

import asyncio
import random
import uuid
from unittest.mock import ANY

import pytest
from redis.asyncio import Redis

from app import keys
from app.broker import reward_store
from app.broker.packing import unpack_rollouts
from app.broker.store import RedisStore, StoreError
from tests.api.support import events
from tests.broker.test_audit_outbox import settle
from tests.broker.test_store import ack, ids, lease, new_run, packed
from tests.services import delete_prefix, new_prefix


async def clease(store: RedisStore, name: str = "c", size: int = 10, **kw):
    kw.setdefault("batch_id", uuid.uuid4().hex)
    kw.setdefault("lease_ms", 60_000)
    return await store.consumer_lease("r", name, size=size, **kw)


async def take(store: RedisStore, name: str = "c", size: int = 100) -> list[str]:
    """Every pending item of the consumer, leased and acked."""
    got = await clease(store, name, size)
    if got is None:
        return []
    await store.consumer_ack("r", name, got.batch_id)
    return got.rollout_ids


async def counts(store: RedisStore, name: str = "c") -> tuple[int, int, int, int, int]:
    v = await store.get_consumer("r", name)
    assert v is not None
    return v.delivered, v.acked, v.dropped, v.leased, v.pending


async def blob_exists(redis: Redis, prefix: str, rid: str) -> bool:
    return await redis.exists(keys.member_key(prefix, "r", keys.BLOB, rid)) == 1


async def holds(redis: Redis, prefix: str) -> tuple[dict, set]:
    refs = await redis.hgetall(keys.run_key(prefix, "r", keys.CONSUMER_REFS))
    orphans = await redis.smembers(keys.run_key(prefix, "r", keys.CONSUMER_ORPHANS))
    return refs, orphans


async def code_of(call) -> str:
    with pytest.raises(StoreError) as err:
        await call
    return err.value.code


# -- the registry ---------------------------------------------------------------------------


async def test_create_is_idempotent_conflicts_and_refuses(store):
    with pytest.raises(StoreError) as err:
        await store.create_consumer("r", "c", source="received")
    assert err.value.code == "run_missing"
    await new_run(store)
    assert await store.create_consumer("r", "c", source="received", max_lag=2) == "created"
    assert await store.create_consumer("r", "c", source="received", max_lag=2) == "exists"
    assert await code_of(store.create_consumer("r", "c", source="trained")) == "consumer_exists"
    assert (  # kind preferences needs groups (tests/broker/test_consumer_pairs.py)
        await code_of(
            store.create_consumer(
                "r", "p", kind="preferences", source="received", min_margin=0, pairs="all"
            )
        )
        == "consumer_invalid"
    )
    assert await code_of(store.create_consumer("r", "c:x", source="received")) == "consumer_invalid"
    assert (
        await code_of(store.create_consumer("r", "d", source="received", retention_rollouts=0))
        == "consumer_invalid"
    )
    view = await store.get_consumer("r", "c")
    assert view is not None and view.config == {
        "kind": "rollouts",
        "source": "received",
        "max_lag": 2,
        "min_margin": None,
        "pairs": None,
        "retention_rollouts": 100_000,
    }
    assert await store.get_consumer("r", "p") is None
    await store.close_run("r")
    assert await code_of(store.create_consumer("r", "e", source="received")) == "run_closed"
    assert await store.delete_consumer("r", "c") is True
    assert await store.delete_consumer("r", "c") is False
    assert await store.get_consumer("r", "c") is None


# -- delivery -------------------------------------------------------------------------------


async def test_received_sees_rewarded_rollouts_from_its_creation_and_stale_ones(store):
    await new_run(store, max_staleness=0)
    await store.ingest("r", [packed("before")])
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", [packed("a"), packed("w", reward=None)])
    assert await take(store) == ["a"]  # w awaits its reward
    await reward_store.score(store, "r", None, {"w": 0.5})
    await store.set_policy("r", 1)  # every buffered rollout goes stale and retires
    assert await take(store) == ["w"]
    got = await clease(store)
    assert got is None
    assert await counts(store) == (2, 2, 0, 0, 0)


async def test_a_stale_retired_rollout_is_still_handed_out_with_its_blob(store):
    await new_run(store, max_staleness=0)
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", [packed("a")])
    await store.set_policy("r", 1)
    got = await clease(store)
    assert got is not None and got.rollout_ids == ["a"]
    assert [r.rollout_id for r in unpack_rollouts(got.blobs)] == ["a"]


async def test_trained_gets_a_rollout_after_its_first_acked_use_once(store):
    await new_run(store, max_reuse=2)
    await store.create_consumer("r", "c", source="trained")
    await store.ingest("r", [packed("a"), packed("b")])
    assert await take(store) == []
    got = await lease(store, 2)
    await store.nack("r", got.batch_id)
    assert await take(store) == []  # a nacked lease is no gradient
    got = await lease(store, 1)
    assert ids(got) == ["a"]
    await ack(store, got)
    assert await take(store) == ["a"]
    for _ in range(2):  # a's second use, b's first
        got = await lease(store, 1)
        await ack(store, got)
    assert await take(store) == ["b"]
    assert (await counts(store))[0] == 2


async def test_a_first_use_a_rewind_undid_is_not_handed_out_again(store, redis, prefix):
    await new_run(store, max_reuse=2)
    await store.create_consumer("r", "c", source="trained")
    await store.ingest("r", [packed("a"), packed("b")])
    await store.set_policy("r", 1)
    await ack(store, await lease(store, 2))  # their first use, at version 1
    assert sorted(await take(store)) == ["a", "b"]
    await store.rewind("r", 0)  # the use is undone: none stands
    got = await lease(store, 2)
    assert [r.uses for r in got.rollouts] == [0, 0]
    await ack(store, got)  # their first use again, for the trainer
    assert await take(store) == []  # but not for the consumer, which had them
    assert await counts(store) == (2, 2, 0, 0, 0)
    assert not await redis.exists(keys.run_key(prefix, "r", keys.CONSUMER_REWOUND))


# -- retention and the blobs ----------------------------------------------------------------


async def test_retention_drops_the_oldest_pending_and_counts_them(store, redis, prefix):
    await new_run(store)
    await store.create_consumer("r", "c", source="received", retention_rollouts=2)
    await store.ingest("r", [packed("a"), packed("b")])
    await store.ingest("r", [packed("c")])
    assert await counts(store) == (3, 0, 1, 0, 2)
    assert await take(store) == ["b", "c"]
    assert await holds(redis, prefix) == ({}, set())


async def retire_a(store: RedisStore) -> None:
    """Rollout a takes its only use and retires (max_reuse)."""
    got = await lease(store, 1)
    assert ids(got) == ["a"]
    await ack(store, got)


async def test_the_blob_of_a_retired_rollout_lives_while_held(store, redis, prefix):
    await new_run(store, max_reuse=1)
    await store.create_consumer("r", "c", source="received")
    await store.create_consumer("r", "t", source="trained")
    await store.ingest("r", [packed("a")])
    await retire_a(store)
    assert await blob_exists(redis, prefix, "a")
    assert await holds(redis, prefix) == ({b"a": b"2"}, {b"a"})
    assert await take(store, "c") == ["a"]
    assert await blob_exists(redis, prefix, "a")  # t still holds it
    got = await clease(store, "t")
    assert got is not None and got.rollout_ids == ["a"]
    await store.consumer_ack("r", "t", got.batch_id)
    assert not await blob_exists(redis, prefix, "a")
    assert await holds(redis, prefix) == ({}, set())


async def test_without_consumers_the_blob_goes_at_retirement(store, redis, prefix):
    await new_run(store, max_reuse=1)
    await store.ingest("r", [packed("a")])
    await retire_a(store)
    assert not await blob_exists(redis, prefix, "a")


async def test_a_drop_frees_the_blob_of_a_retired_rollout(store, redis, prefix):
    await new_run(store, max_reuse=1)
    await store.create_consumer("r", "c", source="received", retention_rollouts=1)
    await store.ingest("r", [packed("a")])
    await retire_a(store)
    assert await blob_exists(redis, prefix, "a")
    await store.ingest("r", [packed("b")])  # retention 1: a is dropped
    assert not await blob_exists(redis, prefix, "a")
    assert await blob_exists(redis, prefix, "b")  # buffered: the trainer's still
    assert await counts(store) == (2, 0, 1, 0, 1)


async def test_a_deleted_consumer_frees_its_pending_and_leased_holds(store, redis, prefix):
    await new_run(store, max_reuse=1)
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", [packed("a"), packed("b")])
    held = await clease(store, size=1)
    assert held is not None and held.rollout_ids == ["a"]
    await retire_a(store)
    got = await lease(store, 1)
    await ack(store, got)  # b retires too
    assert await blob_exists(redis, prefix, "a") and await blob_exists(redis, prefix, "b")
    assert await store.delete_consumer("r", "c")
    assert not await blob_exists(redis, prefix, "a")
    assert not await blob_exists(redis, prefix, "b")
    assert await holds(redis, prefix) == ({}, set())
    names = {k.decode() async for k in redis.scan_iter(match=f"{prefix}:*")}
    base = keys.run_base(prefix, "r")
    assert not [n for n in names if n.startswith((base + "cq:", base + "cs:", base + "cl:"))]


async def test_deleting_the_run_frees_what_consumers_hold(store, redis, prefix):
    await new_run(store, max_reuse=1)
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", [packed("a"), packed("b")])
    assert await clease(store, size=1) is not None
    await retire_a(store)
    await store.close_run("r")
    await settle(redis, prefix)
    # What the consumer holds (a leased, b pending) is dropped and counted; the delete waits
    # for the accounting to apply that.
    assert await code_of(store.delete_run("r")) == "run_busy"
    assert (await events(redis, prefix, "r"))[-1] == (
        "consumers",
        {"items": [["c", 0, 0, 2]], "t": ANY},
    )
    await redis.xgroup_setid(keys.events_key(prefix, "r"), keys.CONSUMER_GROUP, id="$")
    await store.delete_run("r")
    names = {k.decode() async for k in redis.scan_iter(match=f"{prefix}:*")}
    base = keys.run_base(prefix, "r")
    consumer_keys = ("cq:", "cs:", "cl:", "cb:", "d:", "cons", "cref", "corph")
    assert not [n for n in names if n.startswith(tuple(base + k for k in consumer_keys))]


# -- leases ---------------------------------------------------------------------------------


async def test_ack_nack_repeat_and_the_original_order(store):
    await new_run(store)
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", [packed("a"), packed("b")])
    first = await clease(store, size=1, batch_id="x")
    assert first is not None and first.rollout_ids == ["a"] and not first.repeat
    again = await clease(store, size=5, batch_id="x")
    assert again is not None and again.rollout_ids == ["a"] and again.repeat
    second = await clease(store, size=5)
    assert second is not None and second.rollout_ids == ["b"]  # never a twice
    await store.ingest("r", [packed("c")])
    assert await store.consumer_nack("r", "c", "x") == ("nacked", 1)
    assert await store.consumer_nack("r", "c", "x") == ("repeat", 1)
    assert await code_of(store.consumer_ack("r", "c", "x")) == "batch_nacked"
    assert await code_of(clease(store, batch_id="x")) == "batch_id_taken"
    assert await take(store) == ["a", "c"]  # a back at its place, before c
    assert await store.consumer_ack("r", "c", second.batch_id) == ("acked", 1)
    assert await store.consumer_ack("r", "c", second.batch_id) == ("repeat", 1)
    assert await code_of(store.consumer_nack("r", "c", second.batch_id)) == "batch_acked"
    assert await code_of(store.consumer_ack("r", "c", "nope")) == "batch_missing"
    assert await code_of(store.consumer_ack("r", "x", "nope")) == "consumer_missing"
    assert await counts(store) == (3, 3, 0, 0, 0)


async def test_an_expired_lease_returns_its_items(store):
    await new_run(store)
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", [packed("a"), packed("b")])
    gone = await clease(store, size=1, lease_ms=0)  # expires at once
    assert gone is not None and gone.rollout_ids == ["a"]
    assert await take(store) == ["a", "b"]  # the next lease call returned a first
    assert await code_of(store.consumer_ack("r", "c", gone.batch_id)) == "lease_expired"
    await store.ingest("r", [packed("c")])
    gone = await clease(store, lease_ms=0)
    assert gone is not None
    await store.sweep("r")  # the maintenance sweep returns it too
    assert await counts(store) == (3, 2, 0, 0, 1)
    assert await take(store) == ["c"]


async def test_leases_of_one_consumer_never_share_an_item(store):
    await new_run(store)
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", [packed(f"x{i}") for i in range(40)])
    got = await asyncio.gather(*(clease(store, size=7) for _ in range(8)))
    leased = [rid for g in got if g is not None for rid in g.rollout_ids]
    assert sorted(leased) == sorted(f"x{i}" for i in range(40))


async def test_max_lag_drops_what_is_too_old_when_handed_out(store, redis, prefix):
    await new_run(store, max_staleness=5)
    await store.create_consumer("r", "c", source="received", max_lag=1)
    await store.ingest("r", [packed("a", 0)])
    await store.set_policy("r", 1)
    await store.ingest("r", [packed("b", 1)])
    await store.set_policy("r", 2)
    assert await take(store) == ["b"]
    assert await counts(store) == (2, 1, 1, 0, 0)
    assert await blob_exists(redis, prefix, "a")  # still the trainer's
    assert await holds(redis, prefix) == ({}, set())


# -- the policy trainer sees the same ------------------------------------------------------


async def trainer_trace(redis: Redis, seed: int, with_consumers: bool) -> list:
    """A seeded interleaving of ingest, trainer lease / ack / nack and version moves on a fresh
    prefix, with consumer calls (of both kinds) between them or not: what the trainer saw."""
    prefix = new_prefix()
    store = RedisStore(redis, prefix)
    rng = random.Random(seed)
    crng = random.Random(seed + 1)  # the consumers' own choices
    trace: list = []
    live: list = []
    await new_run(store, order="fifo", max_reuse=2, max_staleness=2, group_size=2)
    if with_consumers:
        await store.create_consumer("r", "c", source="received", retention_rollouts=5)
        await store.create_consumer("r", "t", source="trained", max_lag=0)
        for name, source in (("p", "received"), ("q", "trained")):
            await store.create_consumer(
                "r", name, kind="preferences", source=source, min_margin=0.0, pairs="all"
            )
    version, n = 0, 0
    try:
        for step in range(120):
            op = rng.random()
            if op < 0.35:
                rows = [
                    packed(f"r{n}-{j}", version, group=f"g{n}", reward=float(j)) for j in range(2)
                ]
                n += 1
                trace.append(("ingest", (await store.ingest("r", rows)).accepted))
            elif op < 0.6:
                got = await store.lease(
                    "r",
                    batch_id=f"b{step}",
                    size=2 * rng.choice([1, 2]),
                    policy_version=None,
                    partial=True,
                    trainer_id="t",
                )
                if not isinstance(got, int):
                    live.append(got)
                    rows = [(r.uses, r.lag) for r in got.rollouts]
                    trace.append(("lease", ids(got), rows))
                else:
                    trace.append(("short", got))
            elif op < 0.8 and live:
                got = live.pop(rng.randrange(len(live)))
                trace.append(("ack", (await ack(store, got))[1].retired))
            elif op < 0.9 and live:
                got = live.pop(rng.randrange(len(live)))
                trace.append(("nack", await store.nack("r", got.batch_id)))
            elif op < 0.95:
                version += 1
                trace.append(("policy", await store.set_policy("r", version)))
            if rng.random() < 0.5 and with_consumers:  # the same draws with and without
                for name in ("c", "t", "p", "q"):
                    got = await store.consumer_lease(
                        "r", name, batch_id=f"{name}{step}", size=3, lease_ms=60_000
                    )
                    if got is not None and crng.random() < 0.5:
                        await store.consumer_ack("r", name, got.batch_id)
                    elif got is not None:
                        await store.consumer_nack("r", name, got.batch_id)
        run = await redis.hmget(keys.run_key(prefix, "r"), "live", "leased", "seq", "adm")
        units = await redis.hgetall(keys.run_key(prefix, "r", keys.UNITS))
        trace.append(("end", run, sorted(units.items())))
        # What the accounting is told: every event but the consumers' own, times aside.
        told = [(e, timeless(d)) for e, d in await events(redis, prefix, "r") if e != "consumers"]
        trace.append(("events", told))
    finally:
        await delete_prefix(redis, prefix)
    return trace


TIMES = ("t", "wait_ms", "created_at", "expires_at")  # clock readings, which differ run to run


def timeless(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in TIMES}


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
async def test_the_trainer_sees_the_same_with_and_without_consumers(redis, seed):
    """The trainer's leases (ids, uses, lags), its acks and nacks, the run's live state and
    every accounting event are the same with consumers reading beside it as without."""
    without = await trainer_trace(redis, seed, with_consumers=False)
    with_ = await trainer_trace(redis, seed, with_consumers=True)
    assert [t[0] for t in without].count("lease") > 5 and "ack" in [t[0] for t in without]
    assert len(without[-1][1]) > 20  # the events compared
    assert with_ == without


async def test_a_group_delivered_and_retired_in_one_call_keeps_its_blobs(store, redis, prefix):
    await new_run(store, group_size=2, drop_zero_variance_groups=True)
    await store.create_consumer("r", "c", source="received")
    # Equal rewards: the group retires zero_variance in the ingest that delivers it.
    await store.ingest("r", [packed("a", group="g"), packed("b", group="g")])
    assert await blob_exists(redis, prefix, "a") and await blob_exists(redis, prefix, "b")
    got = await clease(store)
    assert got is not None and sorted(got.rollout_ids) == ["a", "b"]
    await store.consumer_ack("r", "c", got.batch_id)
    assert not await blob_exists(redis, prefix, "a")
    assert await holds(redis, prefix) == ({}, set())
