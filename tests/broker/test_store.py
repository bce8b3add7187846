"""The Lua scripts, called directly through the store on a real Redis: every rule and reason,
and the accounting event each change leaves behind."""

from __future__ import annotations

import asyncio
import math
import struct
import time
import uuid
from collections import Counter

import msgpack
import pytest

from app import keys
from app.broker.config import RunConfig
from app.broker.packing import pack_rollout, unpack_rollouts
from app.broker.store import Lease, RedisStore, StoreError


def packed(rid, version=0, *, group=None, reward=1.0, tokens=3):
    return pack_rollout(
        rollout_id=rid,
        group_id=group,
        policy_version=version,
        prompt_ids=None,
        response_ids=list(range(1, tokens + 1)),
        logprobs=[-0.5] * tokens,
        reward=reward,
        finish_reason=None,
        metadata=None,
        max_tokens=4096,
    )


async def events(store: RedisStore, run_id: str = "r") -> list[tuple[str, dict]]:
    out = []
    for _, f in await store.redis.xrange(store.events_key(run_id)):
        out.append((f[b"e"].decode(), msgpack.unpackb(f[b"d"], raw=False)))
    return out


async def retired(store: RedisStore, run_id: str = "r") -> dict[str, list[str]]:
    got: dict[str, list[str]] = {}
    for e, d in await events(store, run_id):
        if e == "retired":
            got.setdefault(d["reason"], []).extend(i[0] for i in d["items"])
    return got


async def lease(store, size, *, version=None, partial=False, run_id="r"):
    return await store.lease(
        run_id,
        batch_id=uuid.uuid4().hex,
        size=size,
        policy_version=version,
        partial=partial,
        trainer_id="t",
    )


def ids(got: Lease) -> list[str]:
    return [r.rollout_id for r in unpack_rollouts([r.blob for r in got.rollouts])]


async def ack(store, got: Lease, *, kl=(), kl_mean=None, run_id="r"):
    # The acked event's items carry the measured KL the script gates on (version and tokens
    # only matter to the accounting).
    items = [[rid, 0, 1, value] for rid, value in kl]
    return await store.ack(
        run_id,
        got.batch_id,
        kl_mean=kl_mean,
        event=msgpack.packb({"batch_id": got.batch_id, "items": items}),
        stats_text="{}",
    )


async def new_run(store, **cfg) -> RunConfig:
    config = RunConfig(**cfg)
    assert await store.create_run("r", config) == "created"
    return config


async def test_create_is_idempotent_and_conflicts_on_another_config(store):
    await new_run(store, max_reuse=2)
    assert await store.create_run("r", RunConfig(max_reuse=2)) == "exists"
    with pytest.raises(StoreError) as err:
        await store.create_run("r", RunConfig(max_reuse=3))
    assert err.value.code == "run_conflict"
    assert [e for e, _ in await events(store)] == ["run"]  # only the real change left an event
    assert await store.run_ids() == ["r"]


async def test_ingest_counts_duplicates_and_rejections_and_remembers_them(store):
    await new_run(store, max_staleness=1)
    await store.set_policy("r", 3)
    out = await store.ingest(
        "r", [packed("a", 3), packed("a", 3), packed("old", 1), packed("fut", 4), packed("b", 2)]
    )
    assert (out.accepted, out.duplicates) == (2, 1)
    assert out.rejected == [("old", "stale"), ("fut", "future_version")]
    again = await store.ingest("r", [packed("a", 3), packed("old", 1), packed("fut", 3)])
    assert (again.accepted, again.duplicates, again.rejected) == (0, 3, [])
    evs = [(e, d) for e, d in await events(store) if e != "run"]
    assert [e for e, _ in evs] == ["accepted", "duplicate", "rejected", "duplicate"]
    assert [i[:4] for i in evs[0][1]["items"]] == [["a", "a", 3, 3], ["b", "b", 2, 3]]
    assert evs[1][1] == {"n": 1, "ids": ["a"], "t": evs[1][1]["t"]}
    assert evs[2][1]["items"] == [["old", "stale", 1, 3], ["fut", "future_version", 4, 3]]
    assert evs[3][1]["n"] == 3


async def test_a_refused_request_stores_nothing(store, redis, prefix):
    await new_run(store, group_size=2, capacity_rollouts=3)
    before = sorted([k async for k in redis.scan_iter(match=f"{prefix}:*")])
    n_events = len(await events(store))
    with pytest.raises(StoreError) as err:
        await store.ingest(
            "r", [packed("a", group="g"), packed("b", group="g"), packed("c", group="g")]
        )
    assert err.value.code == "group_overflow"
    with pytest.raises(StoreError) as err:
        await store.ingest("r", [packed(f"x{i}", group=f"g{i // 2}") for i in range(4)])
    assert err.value.code == "over_capacity"
    with pytest.raises(StoreError) as err:
        await store.ingest("r", [packed("a", group="g"), packed("nogroup")])
    assert err.value.code == "group_missing"
    assert sorted([k async for k in redis.scan_iter(match=f"{prefix}:*")]) == before
    assert len(await events(store)) == n_events


async def test_group_overflow_is_checked_across_requests(store):
    await new_run(store, group_size=2)
    await store.ingest("r", [packed("a", group="g")])
    await store.ingest("r", [packed("b", group="g")])
    with pytest.raises(StoreError) as err:
        await store.ingest("r", [packed("c", group="g")])
    assert err.value.code == "group_overflow"


async def test_freshest_order_is_highest_version_then_oldest_arrival(store):
    await new_run(store, max_staleness=5)
    await store.set_policy("r", 3)
    await store.ingest("r", [packed("v1a", 1), packed("v3a", 3), packed("v2a", 2)])
    await store.ingest("r", [packed("v3b", 3), packed("v1b", 1)])
    got = await lease(store, 5)
    assert ids(got) == ["v3a", "v3b", "v2a", "v1a", "v1b"]
    assert [r.lag for r in got.rollouts] == [0, 0, 1, 2, 2]


async def test_fifo_order_is_lowest_version_first(store):
    await new_run(store, max_staleness=5, order="fifo")
    await store.set_policy("r", 3)
    await store.ingest("r", [packed("a", 1), packed("b", 3), packed("c", 2), packed("d", 1)])
    assert ids(await lease(store, 4)) == ["a", "d", "c", "b"]


async def test_random_order_returns_distinct_eligible_rollouts(store):
    await new_run(store, order="random")
    await store.ingest("r", [packed(f"x{i}") for i in range(40)])
    seen: set[str] = set()
    batches = []
    for _ in range(4):
        got = ids(await lease(store, 10))
        assert len(set(got)) == 10 and not (seen & set(got))
        seen |= set(got)
        batches.append(got)
    assert seen == {f"x{i}" for i in range(40)}
    # Neither end of the arrival order: a uniform draw is one of them once in 4e8.
    assert set(batches[0]) != {f"x{i}" for i in range(10)}
    assert set(batches[0]) != {f"x{i}" for i in range(30, 40)}


async def test_random_order_draws_differently_each_time(store):
    """The whole buffer fits in one ZRANDMEMBER sample, which Redis returns in index order;
    the lease must still draw a different rollout from call to call."""
    await new_run(store, order="random")
    await store.ingest("r", [packed(f"x{i}") for i in range(20)])
    drawn = Counter()
    for _ in range(60):
        got = await lease(store, 1)
        drawn[ids(got)[0]] += 1
        assert (await store.nack("r", got.batch_id))[0] == "nacked"
    # Uniform draws: fewer than 8 distinct of 20 in 60 draws has probability below 1e-12.
    assert len(drawn) >= 8, drawn


async def test_whole_batches_only_unless_partial(store):
    await new_run(store)
    await store.ingest("r", [packed("a"), packed("b")])
    assert await lease(store, 3) == 2  # not enough: nothing leased, the count comes back
    got = await lease(store, 3, partial=True)
    assert sorted(ids(got)) == ["a", "b"]
    assert await lease(store, 1, partial=True) == 0


async def test_reuse_until_max_reuse_then_retire(store):
    await new_run(store, max_reuse=3)
    await store.ingest("r", [packed("a")])
    for use in range(3):
        got = await lease(store, 1)
        assert ids(got) == ["a"] and got.rollouts[0].uses == use
        assert (await ack(store, got))[0] == "acked"
    assert await lease(store, 1) == 0
    assert await retired(store) == {"max_reuse": ["a"]}
    assert (await store.get_run("r")).live == 0


async def test_kl_above_kl_max_retires_the_whole_group(store):
    await new_run(store, max_reuse=5, group_size=2, kl_max=0.05)
    await store.ingest(
        "r",
        [
            packed("a", group="g"),
            packed("b", group="g"),
            packed("c", group="h"),
            packed("d", group="h"),
        ],
    )
    got = await lease(store, 4)
    outcome, answer = await ack(store, got, kl=[("a", 0.01), ("b", 0.2), ("c", 0.04)])
    assert outcome == "acked" and (answer.retired, answer.flushed) == (2, 0)
    assert await retired(store) == {"kl": ["a", "b"]}
    again = await lease(store, 2)
    assert sorted(ids(again)) == ["c", "d"]


async def test_kl_flush_retires_older_versions_and_raises_the_floor(store):
    await new_run(store, max_staleness=10, max_reuse=5, kl_flush=0.1, kl_max=1.0)
    await store.ingest("r", [packed("old1", 0), packed("old2", 0)])
    await store.set_policy("r", 2)
    await store.ingest("r", [packed("new", 2), packed("mid", 1)])
    got = await lease(store, 1)
    assert ids(got) == ["new"]
    outcome, answer = await ack(store, got, kl=[("new", 0.5)], kl_mean=0.5)
    assert outcome == "acked" and (answer.retired, answer.flushed) == (0, 3)
    assert sorted((await retired(store))["kl_flush"]) == ["mid", "old1", "old2"]
    # Below the floor is refused at ingest too, as stale: it is as far off-policy as the flushed.
    out = await store.ingest("r", [packed("late", 1), packed("ok", 2)])
    assert out.rejected == [("late", "stale")] and out.accepted == 1


@pytest.mark.one_node  # the scripts' own limit: a cluster adds nothing to it
async def test_a_flush_and_a_random_lease_past_a_script_page_of_units(store):
    # A script can pass at most about 8,000 values to one command (Lua's stack): a random
    # lease of 4,100 (a sample of 8,232 candidates) and a flush of 9,000 go page by page.
    await new_run(store, max_staleness=10, max_reuse=5, kl_flush=0.1, order="random")
    for part in range(9):
        await store.ingest("r", [packed(f"old{part}.{i}", 0) for i in range(1000)])
    await store.set_policy("r", 1)
    got = await lease(store, 4100, version=1)
    assert len(set(ids(got))) == 4100 and {x.lag for x in got.rollouts} == {1}
    outcome, answer = await ack(store, got, kl_mean=0.5)
    assert outcome == "acked"
    # Every version-0 unit goes, those of this batch too once they are back.
    assert answer.flushed == 9000 and len(set((await retired(store))["kl_flush"])) == 9000


async def test_a_lowered_limit_retires_lazily_at_lease(store):
    await new_run(store, max_reuse=3, max_staleness=5)
    await store.set_policy("r", 4)
    await store.ingest("r", [packed("used", 4), packed("old", 0), packed("fresh", 4)])
    await ack(store, await lease(store, 1))  # 'used' now has one use
    cfg = (await store.get_run("r")).config_json
    await store.replace_config("r", cfg, RunConfig(max_reuse=1, max_staleness=1))
    # 'fresh' comes first among version 4 (fewer uses): a second rollout makes the lease
    # look past it, at 'used'.
    assert ids(await lease(store, 2, partial=True)) == ["fresh"]
    assert await retired(store) == {"max_reuse": ["used"], "stale": ["old"]}


async def test_policy_advance_evicts_in_bounded_steps(store):
    await new_run(store, max_staleness=0)
    await store.ingest("r", [packed(f"x{i}") for i in range(25)])
    await store.ingest("r", [packed("g1", group=None)])
    assert await store.set_policy("r", 1) == (1, 26)
    assert await store.set_policy("r", 1) == (1, 0)
    with pytest.raises(StoreError) as err:
        await store.set_policy("r", 0)
    assert (err.value.code, err.value.args_) == ("version_backwards", ("1",))
    await store.ingest("r", [packed(f"y{i}", 1) for i in range(25)])
    await store.redis.hset(store.run_key("r"), "ver", 2)  # move on without the eager eviction
    steps = []
    while True:
        step = await store.sweep("r", limit=10)
        steps.append(step.total)
        if not step.more:
            break
    assert steps[:3] == [10, 10, 5] and sum(steps) == 25


async def test_incomplete_groups_time_out_and_zero_variance_groups_drop(store):
    await new_run(store, group_size=2, drop_zero_variance_groups=True, group_timeout_s=0.05)
    await store.ingest(
        "r", [packed("a", group="same", reward=1.0), packed("b", group="same", reward=1.0)]
    )
    await store.ingest(
        "r", [packed("c", group="diff", reward=0.0), packed("d", group="diff", reward=1.0)]
    )
    await store.ingest("r", [packed("e", group="lonely")])
    assert await retired(store) == {"zero_variance": ["a", "b"]}
    assert await lease(store, 4) == 2  # the lonely group is never handed out
    deadline = time.monotonic() + 5
    while "incomplete_group" not in await retired(store) and time.monotonic() < deadline:
        await store.sweep("r")
        await asyncio.sleep(0.02)
    assert (await retired(store))["incomplete_group"] == ["e"]


async def test_rewards_compare_as_exact_doubles(store):
    await new_run(store, group_size=2, drop_zero_variance_groups=True)
    # equal to 14 significant digits, different as doubles: not a zero-variance group
    await store.ingest(
        "r", [packed("a", group="g", reward=0.1), packed("b", group="g", reward=0.1 + 2**-55)]
    )
    assert await retired(store) == {}


async def test_expired_leases_return_unused_and_acks_then_fail(store):
    await new_run(store, lease_timeout_s=0.05)
    await store.ingest("r", [packed("a")])
    got = await lease(store, 1)
    await asyncio.sleep(0.1)  # the lease's own clock has to pass; nothing races here
    with pytest.raises(StoreError) as err:
        await ack(store, got)
    assert err.value.code == "lease_expired"
    again = await lease(store, 1)
    assert ids(again) == ["a"] and again.rollouts[0].uses == 0
    assert [e for e, _ in await events(store)].count("expired") == 1


async def test_nack_returns_unused_and_is_idempotent(store):
    await new_run(store)
    await store.ingest("r", [packed("a")])
    got = await lease(store, 1)
    assert await store.nack("r", got.batch_id) == ("nacked", 1)
    assert await store.nack("r", got.batch_id) == ("repeat", 1)
    with pytest.raises(StoreError) as err:
        await ack(store, got)
    assert err.value.code == "batch_nacked"
    again = await lease(store, 1)
    assert again.rollouts[0].uses == 0
    assert (await ack(store, again))[0] == "acked"
    with pytest.raises(StoreError) as err:
        await store.nack("r", again.batch_id)
    assert err.value.code == "batch_acked"


async def test_close_retires_buffered_now_and_leased_when_they_return(store):
    await new_run(store, max_reuse=2)
    await store.ingest("r", [packed("a"), packed("b")])
    got = await lease(store, 1)
    await store.close_run("r")
    assert await retired(store) == {"run_closed": ["b"]}
    await ack(store, got)
    assert (await retired(store))["run_closed"] == ["b", "a"]
    out = await store.ingest("r", [packed("c")])
    assert out.rejected == [("c", "run_closed")]


async def test_lease_above_current_version_is_refused(store):
    await new_run(store)
    with pytest.raises(StoreError) as err:
        await lease(store, 1, version=1)
    assert (err.value.code, err.value.args_) == ("version_future", ("0",))


async def test_concurrent_leases_never_share_a_rollout(store, redis):
    await new_run(store, max_reuse=1)
    await store.ingest("r", [packed(f"x{i}") for i in range(300)])
    got = await asyncio.gather(*(lease(store, 7, partial=True) for _ in range(60)))
    taken = [i for g in got if isinstance(g, Lease) for i in ids(g)]
    assert len(taken) == len(set(taken)) == 300


async def test_event_stream_balances_with_the_live_counts(store):
    await new_run(store, max_reuse=2, group_size=2, max_staleness=1)
    await store.ingest("r", [packed(f"x{i}", group=f"g{i // 2}") for i in range(10)])
    first = await lease(store, 4)
    await ack(store, first, kl=[(i, 0.5 if n == 0 else 0.0) for n, i in enumerate(ids(first))])
    second = await lease(store, 2)
    await store.nack("r", second.batch_id)
    await lease(store, 2)
    await store.set_policy("r", 2)
    run = await store.get_run("r")
    received = retired_n = leased = 0
    for e, d in await events(store):
        if e == "accepted":
            received += len(d["items"])
        elif e == "retired":
            retired_n += len(d["items"])
        elif e == "leased":
            leased += len(d["items"])
        elif e in ("acked", "nacked", "expired"):
            leased -= len(d["items"])
    assert leased == run.leased == 2
    assert received - retired_n == run.live


async def test_measured_kl_is_kept_exactly_for_the_lease_time_gate(store):
    """The KL an ack measured is stored per unit and read again when a tightened kl_max is
    checked at lease time: one ulp above the new bound must still count as above it."""
    cfg = await new_run(store, max_reuse=3, kl_max=0.06)
    await store.ingest("r", [packed("a"), packed("b")])
    got = await lease(store, 2)
    just_above = math.nextafter(0.05, 1.0)
    await ack(store, got, kl=[("a", just_above), ("b", 0.05)])
    assert await retired(store) == {}  # both within 0.06
    tightened = cfg.model_copy(update={"kl_max": 0.05})
    assert await store.replace_config("r", cfg.canonical_json(), tightened) == "replaced"
    assert ids(await lease(store, 2, partial=True)) == ["b"]  # 0.05 is not above 0.05
    assert await retired(store) == {"kl": ["a"]}


async def test_evicted_is_the_stale_retirements_of_every_bounded_step(store):
    await new_run(store, max_staleness=0, group_size=2, group_timeout_s=0.05)
    await store.ingest("r", [packed(f"x{i}", group=f"g{i // 2}") for i in range(50)])
    await store.ingest("r", [packed("lonely", group="open")])
    await asyncio.sleep(0.1)  # the open group timed out: its retirement is no eviction
    # 25 complete groups and 1 timed-out one, at most 10 units a step: three follow-up sweeps.
    assert await store.set_policy("r", 1, limit=10) == (1, 50)
    assert sorted(await retired(store)) == ["incomplete_group", "stale"]
    assert len((await retired(store))["stale"]) == 50


def _as_text_record(record: bytes) -> bytes:
    """A binary unit record (lua/lib/units.lua) in the text form of earlier versions."""
    fmt = "<Bddiiidi"
    _, v, seq, uses, k, n, kl, att = struct.unpack_from(fmt, record)
    pk = record[struct.calcsize(fmt) :].decode()
    fields = [int(v), int(seq), uses, k, n, "" if math.isnan(kl) else f"{kl:.17g}"]
    return ",".join(str(x) for x in [*fields, "" if att < 0 else att, pk]).encode()


async def test_unit_records_of_an_earlier_version_are_read_and_rewritten(store, prefix):
    """A run whose unit records are in the text form of earlier versions keeps its uses and its
    measured KLs exactly (one ulp above a tightened kl_max still counts as above it), and each
    record is written in the binary form when its unit next changes."""
    cfg = await new_run(store, max_reuse=3, kl_max=0.06)
    await store.ingest("r", [packed("a"), packed("b"), packed("c")])
    await ack(store, await lease(store, 3), kl=[("a", math.nextafter(0.05, 1.0)), ("b", 0.05)])
    units = keys.run_key(prefix, "r", keys.UNITS)
    for u, record in (await store.redis.hgetall(units)).items():
        assert record[:1] == b"\x01"
        await store.redis.hset(units, u, _as_text_record(record))
    tightened = cfg.model_copy(update={"kl_max": 0.05})
    assert await store.replace_config("r", cfg.canonical_json(), tightened) == "replaced"
    got = await lease(store, 3, partial=True)
    assert sorted(ids(got)) == ["b", "c"] and {r.uses for r in got.rollouts} == {1}
    assert await retired(store) == {"kl": ["a"]}
    await ack(store, got)
    records = await store.redis.hgetall(units)
    assert sorted(records) == [b"r:b", b"r:c"]
    assert all(r[:1] == b"\x01" for r in records.values())
    # Their third use retires them, the first counted from the text records.
    assert (await ack(store, await lease(store, 2)))[0] == "acked"
    assert await lease(store, 1) == 0
    assert sorted((await retired(store))["max_reuse"]) == ["b", "c"]


async def test_a_random_lease_draws_from_every_version_up_to_its_own(store):
    """Each version's ready units are drawn from in proportion to their number, none above the
    lease's version: with 2,000 of version 0 and 40 of version 1, a lease of 10 draws at most
    2 of version 1 (a draw of as many from each version would draw more in most leases), and
    30 leases draw some (none: a chance below 1e-5); at its version, a lease of every ready
    unit gets all of them."""
    await new_run(store, order="random", max_staleness=5)
    await store.set_policy("r", 2)
    for v, n in ((0, 2000), (1, 40), (2, 40)):
        for i in range(0, n, 500):
            await store.ingest("r", [packed(f"v{v}.{j}", v) for j in range(i, min(i + 500, n))])
    drawn: Counter[str] = Counter()
    for _ in range(30):
        got = await lease(store, 10, version=1)
        per = Counter(x.split(".")[0] for x in ids(got))
        assert per["v1"] <= 2 and set(per) <= {"v0", "v1"}, per
        drawn += per
        assert (await store.nack("r", got.batch_id))[0] == "nacked"
    assert set(drawn) == {"v0", "v1"}
    everything = Counter(x.split(".")[0] for x in ids(await lease(store, 2080)))
    assert everything == {"v0": 2000, "v1": 40, "v2": 40}


async def test_a_run_of_layout_3_loses_its_arrival_index_and_keeps_its_units(store, prefix):
    """Layout 3 also kept every ready unit in P:{R}:q, which nothing reads now: the first call
    that loads the run removes it and marks the run layout 4."""
    await new_run(store)
    await store.ingest("r", [packed("a"), packed("b")])
    run, queue = keys.run_key(prefix, "r"), keys.run_key(prefix, "r", keys.QUEUE)
    assert await store.redis.hget(run, "lay") == b"4"
    await store.redis.hset(run, "lay", "3")
    await store.redis.zadd(queue, {"r:a": 1, "r:b": 2})
    assert sorted(ids(await lease(store, 2))) == ["a", "b"]
    assert await store.redis.hget(run, "lay") == b"4"
    assert await store.redis.exists(queue) == 0


async def test_a_batch_leased_before_the_binary_records_is_acked_after_them(store, prefix):
    """A batch keeps each unit's record as it was at lease time: one leased by an earlier
    version, text records and all, is acked by this one, and its units come back with one use."""
    await new_run(store, max_reuse=3)
    await store.ingest("r", [packed("a"), packed("b")])
    got = await lease(store, 2)
    batch = keys.run_key(prefix, "r", keys.BATCH + got.batch_id)
    # Unit id, its record at lease time, its rollout count, per unit, as Lua strings.
    units = msgpack.unpackb(await store.redis.hget(batch, "units"), raw=True)
    for i in range(0, len(units), 3):
        assert units[i + 1][:1] == b"\x01"
        units[i + 1] = _as_text_record(units[i + 1])
    await store.redis.hset(batch, "units", msgpack.packb(units, use_bin_type=False))
    assert (await ack(store, got))[0] == "acked"
    again = await lease(store, 2)
    assert sorted(ids(again)) == ["a", "b"] and {r.uses for r in again.rollouts} == {1}
