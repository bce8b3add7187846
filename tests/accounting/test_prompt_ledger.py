"""The prompt ledger: prompt passes and waits folded from the `registered`, `work_leased`,
`passes`, `waited` and `leased` events, whatever order they are applied in; the figures of the
accounting answer; the prompts listing; events that cannot be applied."""

from __future__ import annotations

import base64
import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import asyncpg
import httpx
import pytest
from accounting_helpers import RunSim, drain_all, entry, register_run, xadd_events
from redis.asyncio import Redis
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import listings, repository
from app.accounting.fold import fold_events
from app.accounting.models import PromptPass, RunTotals
from app.accounting.passes import MAX_PASSES, PassState
from app.accounting.stream import EventStream
from app.db import create_engine, create_sessionmaker, upgrade_to_head
from app.events import Event, decode_entry
from app.keys import CONSUMER_GROUP, PASS, dead_key, events_key, member_key
from tests.api.support import set_policy
from tests.helpers import make_run, post, rollout
from tests.services import DATABASE_PREFIX, PG_URL, drop_database, url_of_database
from workers.drain import DrainContext, drain_once

COUNTERS = (
    "prompts_registered",
    "prompts_queued",
    "prompts_in_flight",
    "prompts_done",
    "prompts_failed",
    "prompts_retried",
    "trainer_wait_ms",
    "generator_wait_ms",
)


# The events that carry prompt passes or waits.
PROMPT_EVENTS = {"registered", "work_leased", "passes", "waited", "leased"}


def _events(run_id: str, sim: RunSim) -> list[Event]:
    return [
        decode_entry(run_id, f"{1000 + i}-0", entry(t, p)) for i, (t, p) in enumerate(sim.events)
    ]


def _sim(run_id: str, seed: int = 41) -> RunSim:
    sim = RunSim(run_id, seed=seed, group_size=2)
    sim.workload(40)
    # Without the groups' means: the newest of those is the stream's newest, which a shuffled
    # stream changes (tests/accounting/test_difficulty_pools.py is about them).
    sim.events = [e for e in sim.events if e[0] != "prompt_scored"]
    sim.means.clear()
    return sim


async def _ledger(sm: async_sessionmaker[AsyncSession], run_id: str) -> dict[str, Any]:
    """The prompt ledger's rows and the run's counters, once the counters are checked against
    the rows."""
    async with sm() as s:
        rows = (
            await s.scalars(
                select(PromptPass)
                .where(PromptPass.run_id == run_id)
                .order_by(PromptPass.prompt_id, PromptPass.pass_)
            )
        ).all()
        totals = await s.get(RunTotals, run_id)
        assert totals is not None
        counted = await s.execute(
            select(PromptPass.state, func.count(), func.sum(PromptPass.attempt - 1))
            .where(PromptPass.run_id == run_id)
            .group_by(PromptPass.state)
        )
    by_state = {state: (n, retried) for state, n, retried in counted.all()}
    counters = {name: getattr(totals, name) for name in COUNTERS}
    # The counters, kept from each row's change, are what the rows say.
    for state in ("queued", "in_flight", "done", "failed"):
        assert counters[f"prompts_{state}"] == by_state.get(state, (0, 0))[0], state
    assert counters["prompts_retried"] == sum(r for _, r in by_state.values())
    return {
        "rows": [(r.prompt_id, r.pass_, r.attempt, r.state, r.tries, r.updated_at) for r in rows],
        "counters": counters,
    }


def _sim_ledger(sim: RunSim) -> list[tuple[str, int, int, str, int]]:
    return [(p, n, s.attempt, s.state, s.tries) for (p, n), s in sorted(sim.passes.items())]


# --- folding, without a database -------------------------------------------------------------


def test_pass_state_order() -> None:
    """Within an attempt queued < in_flight < done/failed; a later attempt beats them all."""
    seq = [
        PassState(1, "queued", 0, 10),
        PassState(1, "in_flight", 0, 20),
        PassState(2, "queued", 1, 30),
        PassState(2, "in_flight", 0, 40),  # a work lease says no tries: the known 1 stays
        PassState(2, "done", 1, 50),
    ]
    for order in itertools.permutations(seq):
        merged = order[0]
        for state in order[1:]:
            merged = merged.merge(state)
        assert merged == PassState(2, "done", 1, 50)
    # Said twice: the earliest time. done and failed at one attempt: one answer either way.
    assert PassState(3, "queued", 2, 9).merge(PassState(3, "queued", 2, 7)).t_ms == 7
    assert PassState(1, "done", 0, 1).merge(PassState(1, "failed", 0, 2)) == PassState(
        1, "failed", 0, 2
    )
    assert PassState(1, "failed", 0, 2).merge(PassState(1, "done", 0, 1)) == PassState(
        1, "failed", 0, 2
    )


def test_fold_of_prompt_events_is_order_free() -> None:
    sim = _sim("fold")
    events = _events("fold", sim)
    kinds = {e.type for e in events}
    assert kinds >= PROMPT_EVENTS
    reference = fold_events(events)
    assert {k: (s.attempt, s.state, s.tries) for k, s in reference.passes.items()} == {
        k: (s.attempt, s.state, s.tries) for k, s in sim.passes.items()
    }
    assert reference.run.prompts_registered == sim.prompts_registered
    assert reference.run.generator_wait_ms == sim.wait_ms["generator"]
    assert reference.run.trainer_wait_ms == sim.wait_ms["trainer"]
    rng = random.Random(5)
    for _ in range(20):
        shuffled = events[:]
        rng.shuffle(shuffled)
        fold = fold_events(shuffled)
        assert fold.passes == reference.passes
        for name in ("prompts_registered", "trainer_wait_ms", "generator_wait_ms"):
            assert getattr(fold.run, name) == getattr(reference.run, name), name


# --- applying, on Postgres -------------------------------------------------------------------


async def test_applied_one_by_one_in_shuffled_orders_gives_one_ledger(
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """Every event in a transaction of its own, in shuffled orders, some applied twice, gives
    the ledger that one in-order transaction gives, and the one the simulator kept."""
    tag = random.Random().getrandbits(32)
    runs = [f"ledger-{n}-{tag}" for n in range(3)]
    sim = _sim(runs[0])
    async with sessionmaker() as s, s.begin():
        await repository.apply_events(s, runs[0], _events(runs[0], sim))
    assert {e.type for e in _events(runs[0], sim)} >= PROMPT_EVENTS
    reference = await _ledger(sessionmaker, runs[0])
    assert [row[:5] for row in reference["rows"]] == _sim_ledger(sim)
    expected = sim.expected()
    assert reference["counters"]["prompts_registered"] == expected["prompts"]["registered"]
    assert reference["counters"]["generator_wait_ms"] == sim.wait_ms["generator"]

    for n, run_id in enumerate(runs[1:], start=1):
        # The rollout events are the other tests' (test_accounting_events.py); without them
        # here, a transaction per event stays quick.
        events = [e for e in _events(run_id, _sim(run_id)) if e.type in PROMPT_EVENTS]
        rng = random.Random(n)
        order = events + rng.sample(events, k=len(events) // 4)  # replays change nothing
        rng.shuffle(order)
        for event in order:
            async with sessionmaker() as s, s.begin():
                await repository.apply_events(s, run_id, [event])
        assert await _ledger(sessionmaker, run_id) == reference


async def test_one_pass_told_out_of_order(
    sessionmaker: async_sessionmaker[AsyncSession], run_id: str
) -> None:
    """Two passes' story arrives backwards, one event per transaction: the counters move with
    the rows (a state left is uncounted) and end where the story ends, as when it is told
    forwards. A state said twice keeps the time it was first said."""

    def ev(n: int, event_type: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return event_type, {"t": 1_000 + n, **payload}

    story = [
        ev(1, "registered", {"items": [["p", 2]]}),
        ev(2, "work_leased", {"lease_id": "w1", "policy_version": 0, "expires_at": 9,
                              "items": [["p", 1, 1], ["p", 2, 1]], "wait_ms": 250}),
        ev(3, "passes", {"cause": "expired", "lease_id": "w1",
                         "items": [["p", 1, 2, "queued", 1], ["p", 2, 2, "queued", 1]]}),
        ev(4, "work_leased", {"lease_id": "w2", "policy_version": 1, "expires_at": 9,
                              "items": [["p", 1, 2]]}),
        ev(5, "passes", {"cause": "acked", "items": [["p", 1, 2, "done", 1]]}),
        ev(6, "waited", {"role": "generator", "wait_ms": 1500}),
        ev(7, "waited", {"role": "trainer", "wait_ms": 40}),
        ev(8, "leased", {"batch_id": "b", "policy_version": 1, "expires_at": 9, "items": [],
                         "wait_ms": 60}),
        ev(9, "passes", {"cause": "retired", "items": [["p", 1, 2, "done", 1]]}),
    ]  # fmt: skip

    async def tell(run: str, story: list[tuple[str, dict[str, Any]]]) -> list[tuple[int, ...]]:
        """Apply the story's events one by one; the counters after each."""
        after = []
        for n, (event_type, payload) in story:
            event = decode_entry(run, f"{n}-0", entry(event_type, payload))
            async with sessionmaker() as s, s.begin():
                await repository.apply_events(s, run, [event])
            totals = (await _ledger(sessionmaker, run))["counters"]
            after.append(
                tuple(totals[f"prompts_{k}"] for k in ("queued", "in_flight", "done", "retried"))
            )
        return after

    numbered = list(enumerate(story, start=1))
    backwards = await tell(run_id, numbered[::-1])
    # 9: pass 1 done at attempt 2; 8 to 4: nothing newer; 3: pass 2 queued at attempt 2;
    # 2 and 1: older than what is there.
    assert backwards == [(0, 0, 1, 1)] * 6 + [(1, 0, 1, 2)] * 3
    forwards = await tell(f"{run_id}-forwards", numbered)
    assert forwards == [
        (2, 0, 0, 0),  # registered: both queued at attempt 1
        (0, 2, 0, 0),
        (2, 0, 0, 2),  # back at attempt 2
        (1, 1, 0, 2),
        (1, 0, 1, 2),
        *[(1, 0, 1, 2)] * 4,
    ]
    ledger = await _ledger(sessionmaker, run_id)
    assert ledger == await _ledger(sessionmaker, f"{run_id}-forwards")
    assert [row[:5] for row in ledger["rows"]] == [("p", 1, 2, "done", 1), ("p", 2, 2, "queued", 1)]
    # The time the pass entered its state, not the newest event's.
    assert [round(row[5].timestamp() * 1000) for row in ledger["rows"]] == [1_005, 1_003]
    assert ledger["counters"]["prompts_registered"] == 2
    assert ledger["counters"]["generator_wait_ms"] == 250 + 1500
    assert ledger["counters"]["trainer_wait_ms"] == 40 + 60


async def test_drained_from_a_shuffled_stream_the_accounting_is_the_same(
    redis: Redis,
    prefix: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
) -> None:
    """The same events written in another order and drained in small batches answer the same
    prompts and wait figures and the same listing, and both match the simulator."""
    sims = [_sim(f"straight-{prefix}", seed=43), _sim(f"shuffled-{prefix}", seed=43)]
    random.Random(7).shuffle(sims[1].events)
    for n, sim in enumerate(sims):
        await register_run(redis, prefix, sim.run_id, n)
        await xadd_events(redis, prefix, sim.run_id, sim.events)
    await drain_all(make_ctx(batch_size=5))

    answers = []
    for sim in sims:
        got = (await accounting_api.get(f"/v1/runs/{sim.run_id}/accounting")).json()
        assert got["pending_events"] == 0
        exp = sim.expected()
        assert got["prompts"] == exp["prompts"]
        assert got["wait"] == pytest.approx(exp["wait"])
        listing = (
            await accounting_api.get(f"/v1/runs/{sim.run_id}/prompts", params={"limit": 1000})
        ).json()
        assert listing["prompts"] == sim.expected_passes()
        answers.append((got["prompts"], got["wait"], listing))
    assert answers[0] == answers[1]
    prompts = answers[0][0]
    assert prompts["registered"] == sum(
        prompts[k] for k in ("queued", "in_flight", "done", "failed")
    )


# --- the listing -----------------------------------------------------------------------------


async def _pages(
    api: httpx.AsyncClient, run_id: str, limit: int, state: str | None = None
) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": limit}
        if state is not None:
            params["state"] = state
        if cursor is not None:
            params["cursor"] = cursor
        resp = await api.get(f"/v1/runs/{run_id}/prompts", params=params)
        assert resp.status_code == 200, resp.text
        page = resp.json()
        assert len(page["prompts"]) <= limit
        # A full page says there is more, unless it was the last one.
        assert page["next_cursor"] is None or len(page["prompts"]) == limit
        seen.extend(page["prompts"])
        cursor = page["next_cursor"]
        if cursor is None:
            return seen


async def test_prompt_listing_pages_and_filters(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
) -> None:
    sim = _sim(run_id, seed=41)
    await register_run(redis, prefix, run_id)
    await xadd_events(redis, prefix, run_id, sim.events)
    await drain_all(make_ctx())

    everything = sim.expected_passes()
    assert len(everything) > 20
    assert await _pages(accounting_api, run_id, 1000) == everything
    assert await _pages(accounting_api, run_id, 3) == everything
    assert await _pages(accounting_api, run_id, 1) == everything
    default = (await accounting_api.get(f"/v1/runs/{run_id}/prompts")).json()
    assert default == {"prompts": everything[:100], "next_cursor": default["next_cursor"]}
    assert (default["next_cursor"] is None) == (len(everything) <= 100)
    for state in ("queued", "in_flight", "done", "failed"):
        listed = await _pages(accounting_api, run_id, 4, state)
        assert listed == sim.expected_passes(state), state
        assert listed, state
    assert list(everything[0]) == ["prompt_id", "pass", "attempt", "state", "tries", "mean"]

    url = f"/v1/runs/{run_id}/prompts"
    for params in (
        {"state": "running"},
        {"state": ""},
        {"cursor": "%%%"},
        {"cursor": base64.urlsafe_b64encode(b'["p-1"]').decode()},
        {"cursor": base64.urlsafe_b64encode(b'["p-1", "2"]').decode()},
        {"cursor": base64.urlsafe_b64encode(b"[1, 2]").decode()},
        {"cursor": base64.urlsafe_b64encode(b"null").decode()},
        {"cursor": base64.urlsafe_b64encode(b'["p-1", 1180591620717411303424]').decode()},
        {"cursor": base64.urlsafe_b64encode(b'["p\\u0000", 1]').decode()},
    ):
        resp = await accounting_api.get(url, params=params)
        assert resp.status_code == 422, params
        assert resp.json()["error"] == "ValidationFailed", params
        assert resp.json()["detail"], params
    for limit in (0, 1001):
        assert (await accounting_api.get(url, params={"limit": limit})).status_code == 422
    last = everything[-1]
    past = base64.urlsafe_b64encode(json.dumps([last["prompt_id"], last["pass"]]).encode())
    assert (await accounting_api.get(url, params={"cursor": past.decode()})).json() == {
        "prompts": [],
        "next_cursor": None,
    }


async def test_prompt_ids_are_listed_in_bytewise_order_whatever_the_locale(
    redis: Redis, prefix: str
) -> None:
    """On a database whose default collation sorts like English (ICU "en": case and
    punctuation ignored first), the listing's order, and so its cursor, is still bytewise."""
    ids = ["b", "B", "a-2", "a10", "a_1", "Ä", "z", "é", "a 1"]
    name = f"{DATABASE_PREFIX}icu_{random.Random().getrandbits(32):08x}"
    admin = await asyncpg.connect(f"{PG_URL}/postgres")
    try:
        await admin.execute(
            f"CREATE DATABASE \"{name}\" TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en'"
        )
    finally:
        await admin.close()
    engine = create_engine(url_of_database(name))
    try:
        await upgrade_to_head(url_of_database(name))
        sm = create_sessionmaker(engine)
        registered = decode_entry(
            "icu", "1-0", entry("registered", {"t": 1, "items": [[p, 1] for p in ids]})
        )
        async with sm() as s, s.begin():
            await repository.apply_events(s, "icu", [registered])
        async with sm() as s:
            collated = await s.scalars(
                text("SELECT x FROM unnest(CAST(:ids AS text[])) AS x ORDER BY x"), {"ids": ids}
            )
            assert list(collated) != sorted(ids)  # the database's own order is not bytewise
            listed: list[str] = []
            cursor = None
            while True:
                page = await listings.list_prompts(
                    s, EventStream(redis, prefix), "icu", state=None, limit=2, cursor=cursor
                )
                listed.extend(p.prompt_id for p in page.prompts)
                cursor = page.next_cursor
                if cursor is None:
                    break
        assert listed == sorted(ids)
    finally:
        await engine.dispose()
        await drop_database(name)


# --- against the broker's live state ---------------------------------------------------------

_LIVE_STATE = {"q": "queued", "w": "in_flight", "b": "in_flight", "d": "done", "f": "failed"}


async def _live_passes(redis: Redis, prefix: str, run: str, *pids: str) -> list[dict[str, Any]]:
    """Pass 1 of each prompt as the broker holds it, in the prompt listing's form."""
    out = []
    for pid in sorted(pids):
        f = await redis.hmget(member_key(prefix, run, PASS, f"{pid}#1"), "st", "att", "tries")
        st, att, tries = (x.decode() for x in f)
        out.append(
            {"prompt_id": pid, "pass": 1, "attempt": int(att), "state": _LIVE_STATE[st],
             "tries": int(tries), "mean": None}
        )  # fmt: skip
    return out


async def test_a_prompt_lost_to_a_stale_rollout_is_queued_in_the_ledger_as_live(
    api: httpx.AsyncClient, redis: Redis, prefix: str, make_ctx: Callable[..., DrainContext]
) -> None:
    """A work lease's rollout rejected `stale` ends its attempt: the ledger sees the pass go
    back to the queue, as the broker holds it."""
    run = "stale-work"
    await make_run(api, run, group_size=1, step_groups=1, max_staleness=0)
    body = {"prompts": [{"prompt_id": p} for p in ("p0", "p1", "p2")]}
    assert (await api.post(f"/v1/runs/{run}/prompts", json=body)).status_code == 202
    work = (await api.post(f"/v1/runs/{run}/work", json={"max_prompts": 1})).json()
    [p0] = work["prompts"]
    await set_policy(api, run, 1)
    resp = await post(api, run, rollout("p0-a", 0, group=p0["group_id"]))
    assert resp.json()["rejected"] == [{"rollout_id": "p0-a", "reason": "stale"}]
    await drain_all(make_ctx())

    live = await _live_passes(redis, prefix, run, "p0", "p1", "p2")
    assert live[0] == {
        "prompt_id": "p0",
        "pass": 1,
        "attempt": 2,
        "state": "queued",
        "tries": 1,
        "mean": None,
    }
    assert (await api.get(f"/v1/runs/{run}/prompts")).json()["prompts"] == live
    acc = (await api.get(f"/v1/runs/{run}/accounting")).json()
    assert acc["pending_events"] == 0 and acc["dead_letters"] == 0
    assert acc["prompts"] == {
        "registered": 3, "queued": 3, "in_flight": 0, "done": 0, "failed": 0, "retried": 1,
        "skipped": 0, "cancelled": 0, "pools": None,
    }  # fmt: skip
    assert acc["rejected"] == {"stale": 1}


# --- events that cannot be applied -----------------------------------------------------------


async def test_prompt_events_that_cannot_be_applied_are_dead_lettered(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
) -> None:
    await register_run(redis, prefix, run_id)
    good = [
        ("registered", {"t": 1, "items": [["p", 1]]}),
        ("waited", {"t": 2, "role": "trainer", "wait_ms": 30}),
    ]
    bad = [
        ("passes", {"t": 3, "cause": "acked", "items": [["p", 1, 1, "lost", 0]]}),
        ("waited", {"t": 4, "role": "critic", "wait_ms": 30}),
        ("registered", {"t": 5, "items": [["q", MAX_PASSES + 1]]}),
    ]
    ids = await xadd_events(redis, prefix, run_id, [good[0], *bad, good[1]])
    ctx = make_ctx(max_deliveries=2)
    first = await drain_once(ctx)
    assert (first.applied, first.retrying) == (2, 3)
    second = await drain_once(ctx)
    assert (second.applied, second.dead) == (0, 3)
    key = events_key(prefix, run_id)
    assert (await redis.xpending(key, CONSUMER_GROUP))["pending"] == 0
    dead = await redis.xrange(dead_key(prefix, run_id))
    assert [f[b"dead.id"] for _, f in dead] == ids[1:4]
    errors = [f[b"dead.error"].decode() for _, f in dead]
    assert "lost" in errors[0] and "critic" in errors[1] and "passes" in errors[2]
    got = (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert got["prompts"] == {
        "registered": 1, "queued": 1, "in_flight": 0, "done": 0, "failed": 0, "retried": 0,
        "skipped": 0, "cancelled": 0, "pools": None,
    }  # fmt: skip
    assert got["wait"] == {"generator_s": 0.0, "trainer_s": 0.03, "reward_s": 0.0}
