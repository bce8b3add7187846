"""A generator's quarantine in the scripts, called through the store on a real Redis: the KL
window each ack moves (against a reference computed here), what a quarantine retires and refuses,
the release, and the uses a rewind undoes per generator."""

from __future__ import annotations

import random
import uuid

import msgpack
import orjson
import pytest

from app import keys
from app.broker.config import RunConfig
from app.broker.packing import pack_rollout
from app.broker.store import StoreError
from tests.broker.test_store import events, ids, lease, retired


def packed(rid, gen, *, version=0, group=None, reward=1.0, tokens=4):
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
        generator_id=gen,
    )


def gen_entry(gen, kl_tokens, kl_sum, samples=1):
    """An ``acked`` event's ``gens`` item (app/events/payloads.py AckedGen)."""
    return [gen, samples, kl_tokens, kl_tokens, kl_sum, kl_tokens, float(kl_tokens), 0, 0]


async def ack_gens(store, batch_id, gens, *, run_id="r"):
    event = {"batch_id": batch_id, "policy_version": 0, "items": [], "gens": gens}
    return await store.ack(
        run_id, batch_id, kl_mean=None, event=msgpack.packb(event), stats_text="{}"
    )


async def new_run(store, **cfg):
    assert await store.create_run("r", RunConfig(**cfg)) == "created"


def window_mean(chunks: list[tuple[int, float]], window: int) -> float | None:
    """The reference: the mean KL over the last ``window`` tokens of (tokens, kl_sum) chunks,
    oldest first, the oldest chunk the window reaches counted for the share it covers; None
    until there are that many tokens."""
    need, total = window, 0.0
    for tokens, kl_sum in reversed(chunks):
        take = min(tokens, need)
        total += kl_sum * take / tokens
        need -= take
        if need == 0:
            return total / window
    return None


async def quarantined(store, gen, run_id="r") -> bool:
    return await store.redis.hexists(
        keys.run_key(store.prefix, run_id, keys.GENERATORS_QUARANTINED), gen
    )


async def test_the_window_judges_exactly_as_the_reference(store):
    """Random batches of one generator's KL: it is quarantined at the first ack whose window
    (its last generator_window_tokens tokens, full) has a mean above generator_kl_max, with
    that mean, and not before."""
    rng = random.Random(7)
    for trial in range(6):
        run = f"w{trial}"
        window, kl_max = rng.choice([50, 100, 257]), 0.05
        cfg = RunConfig(generator_kl_max=kl_max, generator_window_tokens=window)
        assert await store.create_run(run, cfg) == "created"
        chunks: list[tuple[int, float]] = []
        expected_at = None
        for step in range(40):
            tokens = rng.randint(1, 90)
            mean = rng.choice([0.01, 0.03, 0.045, 0.06])
            chunks.append((tokens, tokens * mean))
            ref = window_mean(chunks, window)
            if ref is not None and ref > kl_max:
                expected_at = (step, ref)
                break
        for step, (tokens, kl_sum) in enumerate(chunks):
            await store.ingest(run, [packed(f"x{step}", "g1")])
            got = await lease(store, 1, run_id=run)
            await ack_gens(store, got.batch_id, [gen_entry("g1", tokens, kl_sum)], run_id=run)
            is_q = await quarantined(store, "g1", run)
            assert is_q == (expected_at is not None and step == expected_at[0]), (trial, step)
        marks = [d for e, d in await events(store, run) if e == "generator"]
        if expected_at is None:
            assert marks == []
        else:
            assert len(marks) == 1
            assert marks[0]["generator_id"] == "g1" and marks[0]["quarantined"] == 1
            assert marks[0]["window_tokens"] == window
            assert marks[0]["kl_mean"] == pytest.approx(expected_at[1], rel=1e-12)


async def test_windows_are_per_generator_and_off_without_a_bound(store):
    await new_run(store, generator_window_tokens=10)  # generator_kl_max null: off
    await store.ingest("r", [packed("a", "g1")])
    got = await lease(store, 1)
    await ack_gens(store, got.batch_id, [gen_entry("g1", 100, 100.0)])
    assert not await quarantined(store, "g1")
    gw = keys.run_key(store.prefix, "r", keys.GENERATOR_WINDOWS)
    assert await store.redis.hlen(gw) == 0  # nothing kept while off

    await store.redis.delete(
        *[k async for k in store.redis.scan_iter(keys.every_key(store.prefix))]
    )
    await new_run(store, generator_kl_max=0.1, generator_window_tokens=10)
    await store.ingest("r", [packed("a", "g1"), packed("b", "g2")])
    got = await lease(store, 2)
    # g1 is far above, g2 below: only g1 goes.
    await ack_gens(store, got.batch_id, [gen_entry("g1", 10, 5.0), gen_entry("g2", 10, 0.5)])
    assert await quarantined(store, "g1") and not await quarantined(store, "g2")


async def test_a_quarantine_retires_what_its_generator_has_buffered_and_refuses_it(store, prefix):
    await new_run(
        store, group_size=2, generator_kl_max=0.05, generator_window_tokens=8, max_reuse=5
    )

    def group(gen, name, reward=1.0, members=2):
        return [
            packed(f"{gen}-{name}-{i}", gen, group=f"{gen}-{name}", reward=reward)
            for i in range(members)
        ]

    await store.ingest("r", group("g1", "held") + group("g2", "held"))
    held = await lease(store, 4)  # both generators' groups, in a lease that stays live
    await store.ingest("r", group("g1", "m"))
    measured = await lease(store, 2)
    for gen in ("g1", "g2"):
        await store.ingest(
            "r", group(gen, "ready") + group(gen, "open", members=1) + group(gen, "wait", None)
        )
    # g1's batch measured far above the bound (mean 1 over the 8-token window).
    outcome, _ = await ack_gens(store, measured.batch_id, [gen_entry("g1", 8, 8.0, samples=2)])
    assert outcome == "acked" and await quarantined(store, "g1")
    names = lambda gen, *units: {f"{gen}-{u}-{i}" for u in units for i in range(2)}  # noqa: E731
    # Ready, filling and awaiting units go now, and the acked batch's own units; the held
    # lease's g1 group when it comes back.
    assert set((await retired(store))["quarantined"]) == names("g1", "m", "ready", "wait") | {
        "g1-open-0"
    }
    await store.nack("r", held.batch_id)
    assert set((await retired(store))["quarantined"]) == names(
        "g1", "m", "ready", "wait", "held"
    ) | {"g1-open-0"}
    # g2 lost nothing: its ready and returned groups lease, the rest is where it was.
    again = await lease(store, 8, partial=True)
    assert set(ids(again)) == names("g2", "ready", "held")
    ug = keys.run_key(prefix, "r", keys.UNIT_GENERATORS)
    assert set(await store.redis.hkeys(ug)) == {
        b"g:g2-ready",
        b"g:g2-held",
        b"g:g2-open",
        b"g:g2-wait",
    }

    # Its posts and its work are refused whole, and nothing of the request is kept.
    with pytest.raises(StoreError) as refused:
        await store.ingest("r", [packed("clean", "g2"), packed("late", "g1", group="g1-late")])
    assert (refused.value.code, refused.value.args_) == ("generator_quarantined", ("g1",))
    assert not await store.redis.sismember(keys.run_key(prefix, "r", keys.SEEN), "clean")
    with pytest.raises(StoreError) as refused:
        await store.work("r", lease_id=uuid.uuid4().hex, max_prompts=1, generator_id="g1")
    assert refused.value.code == "generator_quarantined"
    assert (
        await store.work("r", lease_id=uuid.uuid4().hex, max_prompts=1, generator_id="g2") is None
    )

    # The event and the audit entry name it; the broker is the actor.
    marks = [d for e, d in await events(store) if e == "generator"]
    assert [(m["generator_id"], m["quarantined"], m["window_tokens"]) for m in marks] == [
        ("g1", 1, 8)
    ]
    assert marks[0]["kl_mean"] == 1.0
    outbox = await store.redis.xrange(keys.outbox_key(prefix, "r"))
    entries = [orjson.loads(f[b"e"]) for _, f in outbox]
    assert [(e["actor"], e["action"], e["detail"]["generator_id"]) for e in entries] == [
        ("broker", "generator.quarantine", "g1")
    ]

    # A release lifts it, once; its window starts afresh.
    entry = orjson.dumps(
        {
            "actor": "ops",
            "token_id": "t",
            "action": "generator.release",
            "run_id": "r",
            "detail": {},
        }
    )
    assert await store.release_generator("r", "g1", entry=entry) == "released"
    assert await store.release_generator("r", "g1", entry=entry) == "not_quarantined"
    assert len(await store.redis.xrange(keys.outbox_key(prefix, "r"))) == 2
    marks = [d for e, d in await events(store) if e == "generator"]
    assert [(m["generator_id"], m["quarantined"]) for m in marks] == [("g1", 1), ("g1", 0)]
    assert (await store.ingest("r", group("g1", "back"))).accepted == 2
    assert not await store.redis.hexists(keys.run_key(prefix, "r", keys.GENERATOR_WINDOWS), "g1")


async def test_a_rewind_counts_the_uses_it_undoes_per_generator(store):
    await new_run(store, max_reuse=3)
    await store.ingest("r", [packed("a", "g1"), packed("b", "g2"), packed("c", None)])
    await store.set_policy("r", 1)
    got = await lease(store, 3)
    gens = [gen_entry("g1", 4, 0.0, samples=2), gen_entry("g2", 4, 0.0)]
    await ack_gens(store, got.batch_id, gens)
    got = await lease(store, 3)
    await ack_gens(store, got.batch_id, [gen_entry("g1", 4, 0.0)])
    await store.rewind("r", 0)
    (rewound,) = [d for e, d in await events(store) if e == "rewound"]
    assert sorted(map(tuple, rewound["gens"])) == [("g1", 3), ("g2", 1)]


async def test_units_leave_the_generator_index_when_they_retire(store, prefix):
    await new_run(store, max_reuse=1)
    await store.ingest("r", [packed(f"x{i}", f"g{i % 3}") for i in range(9)])
    ug = keys.run_key(prefix, "r", keys.UNIT_GENERATORS)
    assert await store.redis.hlen(ug) == 9
    got = await lease(store, 9)
    await ack_gens(store, got.batch_id, [])
    assert await store.redis.hlen(ug) == 0  # used up: retired 'max_reuse'
