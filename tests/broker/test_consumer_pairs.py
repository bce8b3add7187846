"""Consumers of kind preferences in Redis (SPEC "Consumers", docs/design.md "Consumers (Redis
core)"): pairs from complete groups (best_worst, all, min_margin, exact margins, ties), made when
the last reward is in or at the first acked use, their prompt, max_lag and retention by pairs,
the blobs a pair holds, stable pair ids, and the configs refused."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from app.broker import reward_store
from app.broker.config import RunConfig
from app.broker.consumer_calls import ConsumerLease
from app.broker.packing import pack_rollout, unpack_rollouts
from app.broker.store import RedisStore, StoreError
from tests.broker import test_consumers as rollouts
from tests.broker.test_consumers import blob_exists, code_of, holds
from tests.broker.test_store import ack, lease, new_run, packed

Pair = tuple[str, str, float]  # chosen, rejected, margin


async def prefs(
    store: RedisStore,
    name: str = "p",
    *,
    source: str = "received",
    pairs: str = "best_worst",
    min_margin: float = 0.0,
    **kw,
) -> None:
    got = await store.create_consumer(
        "r", name, kind="preferences", source=source, pairs=pairs, min_margin=min_margin, **kw
    )
    assert got == "created"


async def clease(store: RedisStore, name: str = "p", size: int = 10, **kw):
    return await rollouts.clease(store, name, size, **kw)


async def counts(store: RedisStore, name: str = "p") -> tuple[int, int, int, int, int]:
    return await rollouts.counts(store, name)


def group(gid: str, *rewards: float | None, version: int = 0, start: int = 0) -> list:
    """Rollouts '<gid><i>' of group gid, one per reward (None: posted without one)."""
    return [
        packed(f"{gid}{start + i}", version, group=gid, reward=w) for i, w in enumerate(rewards)
    ]


def pairs_of(got: ConsumerLease | None) -> list[Pair]:
    assert got is not None and got.pairs is not None
    return [(p.chosen, p.rejected, p.margin) for p in got.pairs]


async def take(store: RedisStore, name: str = "p", size: int = 100) -> list[Pair]:
    """Every pending pair of the consumer, leased and acked."""
    got = await clease(store, name, size)
    if got is None:
        return []
    await store.consumer_ack("r", name, got.batch_id)
    return pairs_of(got)


# -- which pairs ----------------------------------------------------------------------------


async def test_best_worst_pairs_the_first_highest_with_the_first_lowest(store):
    await new_run(store, group_size=4)
    await prefs(store)
    await store.ingest("r", group("a", 0.5, 1.0, 1.0, 0.0))
    await store.ingest("r", group("b", 0.0, 0.3, 0.3, 0.0))  # ties at both ends
    await store.ingest("r", group("c", 0.1, 0.3, 0.2, 0.2))
    got = await clease(store)
    assert pairs_of(got) == [("a1", "a3", 1.0), ("b1", "b0", 0.3), ("c1", "c0", 0.3 - 0.1)]
    assert got is not None and got.rollout_ids == ["a1", "a3", "b1", "b0", "c1", "c0"]
    assert [r.rollout_id for r in unpack_rollouts(got.blobs)] == got.rollout_ids
    assert [p.prompt_id for p in got.pairs or []] == [None] * 3
    assert await counts(store) == (3, 0, 0, 3, 0)


async def test_all_gives_every_pair_whose_rewards_differ_by_min_margin(store, redis, prefix):
    await new_run(store, group_size=4)
    await prefs(store, "all", pairs="all", min_margin=0.5)
    await prefs(store, "big", pairs="all", min_margin=0.75)
    await prefs(store, "none", min_margin=1.5)
    await store.ingest("r", group("a", 0.0, 0.5, 0.5, 1.0))
    got = await clease(store, "all")
    assert pairs_of(got) == [
        ("a1", "a0", 0.5),
        ("a2", "a0", 0.5),
        ("a3", "a0", 1.0),
        ("a3", "a1", 0.5),  # a1 and a2 are equal: no pair
        ("a3", "a2", 0.5),
    ]
    assert got is not None and got.rollout_ids == ["a1", "a0", "a2", "a3"]
    assert await take(store, "big") == [("a3", "a0", 1.0)]
    assert await take(store, "none") == []
    assert await counts(store, "all") == (5, 0, 0, 5, 0)
    assert await counts(store, "none") == (0, 0, 0, 0, 0)
    # One hold per pair that names a rollout: the acked "big" pair let its holds go.
    assert (await holds(redis, prefix))[0] == {b"a0": b"3", b"a1": b"2", b"a2": b"2", b"a3": b"3"}


async def test_a_margin_is_exact_and_equal_rewards_prefer_neither(store):
    await new_run(store, group_size=2)
    await prefs(store, pairs="all")
    await store.ingest("r", group("a", 0.1, 0.3))
    await store.ingest("r", group("b", 0.3, 0.3))
    await store.ingest("r", group("c", 1e12, -1e12))
    got = await take(store)
    assert got == [("a1", "a0", 0.3 - 0.1), ("c0", "c1", 2e12)]
    assert got[0][2] != 0.2  # the difference of the doubles, to the last bit


async def regroup(store: RedisStore, config: RunConfig, size: int) -> RunConfig:
    new = config.model_copy(update={"group_size": size})
    assert await store.replace_config("r", config.canonical_json(), new) == "replaced"
    return new


# -- when: the last reward in, the first acked use ------------------------------------------


async def test_pairs_come_when_the_last_posted_reward_completes_the_group(store):
    await new_run(store, group_size=3)
    await prefs(store, pairs="all")
    await store.ingest("r", group("a", 0.1))  # read back from its blob later
    await store.ingest("r", group("a", 0.9, start=1))
    assert await take(store) == []
    await store.ingest("r", group("a", 0.4, start=2))
    assert await take(store) == [
        ("a1", "a0", 0.9 - 0.1),
        ("a2", "a0", 0.4 - 0.1),
        ("a1", "a2", 0.9 - 0.4),
    ]


async def test_pairs_of_groups_scored_later_through_reward_leases(store):
    await new_run(store, group_size=3)
    await prefs(store)
    await store.ingest("r", group("a", 0.25, None))
    await store.ingest("r", group("a", None, start=2))
    got = await reward_store.lease(store, "r", lease_id="lease-01", max_rollouts=10, worker_id="w")
    assert got is not None and len(got.rollouts) == 2
    await reward_store.score(store, "r", "lease-01", {"a1": 0.75})
    assert await take(store) == []  # a2 still awaits its reward
    await reward_store.score(store, "r", "lease-01", {"a2": -0.5})
    assert await take(store) == [("a1", "a2", 1.25)]
    # A reward for a member of a group still filling: the ingest that completes it pairs.
    await store.ingest("r", group("b", None))
    await reward_store.score(store, "r", None, {"b0": 0.5})
    assert await take(store) == []
    await store.ingest("r", group("b", 0.0, 1.0, start=1))
    assert await take(store) == [("b2", "b1", 1.0)]


async def test_a_group_partly_posted_before_the_consumers_creation(store):
    await new_run(store, group_size=2)
    await store.ingest("r", group("a", 0.0, 1.0))  # complete before: never delivered
    await store.ingest("r", group("b", 1.0))
    await prefs(store)
    await store.ingest("r", group("b", 0.0, start=1))
    assert await take(store) == [("b0", "b1", 1.0)]


async def test_trained_pairs_come_at_the_first_acked_use_only(store):
    await new_run(store, group_size=2, max_reuse=2)
    await prefs(store, source="trained")
    await store.ingest("r", group("a", 0.0, 1.0))
    assert await take(store) == []
    got = await lease(store, 2)
    await store.nack("r", got.batch_id)
    assert await take(store) == []  # a nacked lease is no gradient
    got = await lease(store, 2)
    await ack(store, got)
    assert await take(store) == [("a1", "a0", 1.0)]
    got = await lease(store, 2)
    await ack(store, got)  # its second use
    assert await take(store) == []
    assert await counts(store) == (1, 1, 0, 0, 0)


async def test_a_pair_of_a_prompt_attempt_names_its_prompt(store):
    await new_run(store, group_size=2)
    await prefs(store)
    await store.register_prompts("r", [("q", b"\x80")], 1)
    work = await store.work("r", lease_id="lease-01", max_prompts=1, generator_id=None)
    assert work is not None
    await store.ingest("r", group(work.items[0].group_id, 0.0, 1.0))
    got = await clease(store)
    assert got is not None and got.pairs is not None and got.pairs[0].prompt_id == "q"


# -- holding, dropping, handing out ---------------------------------------------------------


async def test_max_lag_drops_a_pair_by_its_older_rollout(store, redis, prefix):
    await new_run(store, group_size=2, max_staleness=5)
    await prefs(store, max_lag=1)
    await store.ingest("r", group("a", 0.0))
    await store.set_policy("r", 1)
    await store.ingest("r", group("a", 1.0, version=1, start=1))
    await store.ingest("r", group("b", 0.0, 1.0, version=1))
    await store.set_policy("r", 2)
    assert await take(store) == [("b1", "b0", 1.0)]
    assert await counts(store) == (2, 1, 1, 0, 0)
    assert await holds(redis, prefix) == ({}, set())


async def test_retention_drops_the_oldest_pairs(store, redis, prefix):
    await new_run(store, group_size=3)
    await prefs(store, pairs="all", retention_rollouts=2)
    await store.ingest("r", group("a", 0.0, 1.0, 2.0))  # three pairs
    assert await counts(store) == (3, 0, 1, 0, 2)
    assert (await holds(redis, prefix))[0] == {b"a0": b"1", b"a1": b"1", b"a2": b"2"}
    assert await take(store) == [("a2", "a0", 2.0), ("a2", "a1", 1.0)]
    assert await holds(redis, prefix) == ({}, set())


async def test_a_pair_keeps_its_blobs_until_its_last_hold_goes(store, redis, prefix):
    await new_run(store, group_size=3, max_reuse=1)
    await prefs(store, pairs="all")
    await store.ingest("r", group("a", 0.0, 1.0, 2.0))
    await ack(store, await lease(store, 3))  # the group retires: max_reuse
    assert (await holds(redis, prefix)) == (
        {b"a0": b"2", b"a1": b"2", b"a2": b"2"},
        {b"a0", b"a1", b"a2"},
    )
    first = await clease(store, size=1)  # (a1, a0)
    assert pairs_of(first) == [("a1", "a0", 1.0)]
    assert first is not None and ids_of(first) == ["a1", "a0"]
    await store.consumer_ack("r", "p", first.batch_id)
    assert await blob_exists(redis, prefix, "a0")  # still in (a2, a0)
    assert (await holds(redis, prefix))[0] == {b"a0": b"1", b"a1": b"1", b"a2": b"2"}
    assert await take(store, size=1) == [("a2", "a0", 2.0)]
    assert not await blob_exists(redis, prefix, "a0")
    assert await blob_exists(redis, prefix, "a2")
    held = await clease(store)
    assert await store.delete_consumer("r", "p")  # a leased pair's holds go with it
    assert held is not None and not await blob_exists(redis, prefix, "a2")
    assert await holds(redis, prefix) == ({}, set())


def ids_of(got: ConsumerLease) -> list[str]:
    return [r.rollout_id for r in unpack_rollouts(got.blobs)]


async def test_a_zero_variance_group_gives_no_pair_and_keeps_no_blob(store, redis, prefix):
    await new_run(store, group_size=2, drop_zero_variance_groups=True)
    await prefs(store)
    await store.ingest("r", group("a", 0.5, 0.5))
    assert not await blob_exists(redis, prefix, "a0")
    assert await holds(redis, prefix) == ({}, set())
    assert await counts(store) == (0, 0, 0, 0, 0)


async def test_a_pair_id_stays_through_nack_and_expiry(store):
    await new_run(store, group_size=3)
    await prefs(store, pairs="all")
    await store.ingest("r", group("a", 0.0, 1.0, 2.0))
    first = await clease(store, size=2)
    assert first is not None and first.pairs is not None
    pair_ids = [p.pair_id for p in first.pairs]
    await store.consumer_nack("r", "p", first.batch_id)
    again = await clease(store, size=2, lease_ms=0)  # expires at once
    assert again is not None and [p.pair_id for p in again.pairs or []] == pair_ids
    rest = await clease(store)
    assert rest is not None and rest.pairs is not None
    assert [p.pair_id for p in rest.pairs] == [*pair_ids, rest.pairs[2].pair_id]
    assert len({p.pair_id for p in rest.pairs}) == 3
    repeat = await clease(store, batch_id=rest.batch_id)
    assert repeat is not None and repeat.repeat and repeat.pairs == rest.pairs
    assert await store.consumer_ack("r", "p", rest.batch_id) == ("acked", 3)


async def test_a_rollouts_consumer_beside_gets_rollouts(store):
    await new_run(store, group_size=2)
    await prefs(store)
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", group("a", 0.0, 1.0))
    got = await clease(store, "c")
    assert got is not None and got.pairs is None and got.rollout_ids == ["a0", "a1"]
    assert await take(store) == [("a1", "a0", 1.0)]


# -- refusals -------------------------------------------------------------------------------


async def refusal(call) -> tuple[str, ...]:
    with pytest.raises(StoreError) as err:
        await call
    return (err.value.code, *err.value.args_)


async def test_configs_refused(store):
    config = await new_run(store)
    one = store.create_consumer(
        "r", "p", kind="preferences", source="received", min_margin=0.0, pairs="all"
    )
    assert await refusal(one) == (
        "consumer_invalid",
        "kind preferences needs groups: the run's group_size is 1",
    )
    await regroup(store, config, 2)
    for margin in (-0.5, float("inf"), float("nan"), None):
        bad = store.create_consumer(
            "r", "p", kind="preferences", source="received", min_margin=margin, pairs="all"
        )
        assert await refusal(bad) == ("consumer_invalid", "min_margin must be a finite number >= 0")
    for rule in ("best", None):
        bad = store.create_consumer(
            "r", "p", kind="preferences", source="received", min_margin=0.0, pairs=rule
        )
        assert await refusal(bad) == ("consumer_invalid", "pairs must be best_worst or all")
    for extra in ({"min_margin": 0.0}, {"pairs": "all"}):
        bad = store.create_consumer("r", "c", source="received", **extra)
        assert await refusal(bad) == (
            "consumer_invalid",
            "min_margin and pairs apply to kind preferences only",
        )
    bad = store.create_consumer("r", "c", kind="pairs", source="received")
    assert await refusal(bad) == ("consumer_invalid", "kind must be rollouts or preferences")
    await prefs(store, min_margin=0.25)
    assert (
        await store.create_consumer(
            "r", "p", kind="preferences", source="received", min_margin=0.25, pairs="best_worst"
        )
        == "exists"
    )
    view = await store.get_consumer("r", "p")
    assert view is not None and view.config["min_margin"] == 0.25
    assert view.config["pairs"] == "best_worst" and view.config["kind"] == "preferences"
    assert await code_of(store.create_consumer("r", "p", source="received")) == "consumer_exists"


# -- the blob's reward ----------------------------------------------------------------------


async def test_the_reward_is_read_from_blobs_of_every_shape(store, redis: Redis):
    """Members posted in an earlier request are read back from their blobs: a long id, a
    prompt, metadata and a generator id around the reward change nothing."""
    await new_run(store, group_size=3)
    await prefs(store, pairs="all")
    long_id = "x" * 200
    first = packed(long_id, group="g", reward=-0.125, tokens=2000)
    await store.ingest("r", [first])
    second = pack_rollout(
        rollout_id="y",
        group_id="g",
        policy_version=0,
        prompt_ids=list(range(300)),
        response_ids=list(range(70000, 70400)),
        logprobs=None,
        reward=3.5,
        finish_reason="stop",
        metadata={"k": [1, {"a": "b"}], "n": None},
        max_tokens=4096,
        generator_id="gen-1",
    )
    await store.ingest("r", [second])
    await store.ingest("r", [packed("z", group="g", reward=1.0)])
    assert await take(store) == [("y", long_id, 3.625), ("z", long_id, 1.125), ("y", "z", 2.5)]
    # Ids of 52 and 53 characters put the tokens' length (bin 16) across the first read's end.
    for n in (52, 53):
        await store.ingest("r", [packed("k" * n, group=f"h{n}", reward=0.5, tokens=400)])
        await store.ingest("r", group(f"h{n}", 0.0, 0.25))
        assert await take(store) == [
            ("k" * n, f"h{n}0", 0.5),
            ("k" * n, f"h{n}1", 0.25),
            (f"h{n}1", f"h{n}0", 0.25),
        ]
