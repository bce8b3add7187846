"""The drain against real Redis and Postgres: invariants, exactly-once, dead letters, trimming."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from accounting_helpers import (
    RunSim,
    assert_matches,
    drain_all,
    entry,
    fields_of,
    pack,
    register_run,
    xadd_events,
)
from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.accounting.models import (
    Batch,
    ProcessedEvent,
    PromptMean,
    PromptPass,
    RunTotals,
    VersionTotals,
)
from app.events import EVENT_TYPES, StreamId, decode_entry
from app.keys import CONSUMER_GROUP, dead_key, events_key
from workers.drain import DrainContext, drain_once

# Per-version columns that do not sum to the run's: keys, maxima, and the KL that is summed
# from per-rollout values per version but from the exact per-token sums per run.
NOT_ADDITIVE = {"run_id", "policy_version", "lag_max", "kl_max", "kl_tokens", "kl_sum"}

SUMMED = (
    "rollouts_received",
    "groups_received",
    "tokens_generated",
    "buffered",
    "leased",
    "samples_consumed",
    "samples_rewound",
    "tokens_consumed",
    "wasted_tokens",
)


async def _snapshot(sm: async_sessionmaker[AsyncSession], run_id: str) -> dict[str, Any]:
    """Every accounting row of a run, to compare before and after a re-delivery."""
    async with sm() as s:
        out: dict[str, Any] = {}
        for model in (RunTotals, VersionTotals, Batch, PromptPass):
            rows = (await s.scalars(select(model).where(model.run_id == run_id))).all()
            out[model.__tablename__] = sorted((fields_of(r) for r in rows), key=repr)
        out["processed"] = len(await repository.processed_ids(s, run_id))
        return out


def _pass_counters(run: RunTotals) -> dict[str, int]:
    return {
        "queued": run.prompts_queued,
        "in_flight": run.prompts_in_flight,
        "done": run.prompts_done,
        "failed": run.prompts_failed,
        "retried": run.prompts_retried,
    }


async def _counted_passes(s: AsyncSession, run_id: str) -> dict[str, int]:
    """The same figures as _pass_counters, counted from the ledger's rows."""
    rows = await s.execute(
        select(PromptPass.state, func.count(), func.sum(PromptPass.attempt - 1))
        .where(PromptPass.run_id == run_id)
        .group_by(PromptPass.state)
    )
    counted = dict.fromkeys(("queued", "in_flight", "done", "failed", "retried"), 0)
    for state, n, retried in rows.all():
        counted[state] = n
        counted["retried"] += retried
    return counted


async def test_invariants_after_mixed_workload(
    redis: Redis,
    prefix: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    sims = [
        RunSim(
            "solo-" + prefix,
            seed=1,
            group_size=1,
            max_reuse=3,
            lua=True,
            rewinds=True,
            generators=3,
        ),
        RunSim(
            "grpo-" + prefix,
            seed=2,
            group_size=4,
            max_reuse=2,
            lua=False,
            rewinds=True,
            generators=2,
        ),
    ]
    for n, sim in enumerate(sims):
        sim.workload(60)
        await register_run(redis, prefix, sim.run_id, n)
        await xadd_events(redis, prefix, sim.run_id, sim.events)
    await drain_all(make_ctx(batch_size=37))

    for sim in sims:
        exp = sim.expected()
        # The workload really is mixed: every kind of event and outcome happened.
        kinds = {t for t, _ in sim.events}
        assert kinds == EVENT_TYPES
        assert exp["reuse_factor"] > 1.0
        assert exp["leased"] > 0 and exp["buffered"] > 0
        assert {"kl", "kl_flush", "max_reuse", "stale", "rewound"} <= set(exp["retired"])
        assert exp["samples_rewound"] > 0
        assert exp["wasted_tokens"] > 0
        assert all(exp["prompts"][k] > 0 for k in ("queued", "in_flight", "done", "failed"))
        assert exp["prompts"]["retried"] > 0
        assert exp["wait"]["generator_s"] > 0 and exp["wait"]["trainer_s"] > 0
        assert exp["wait"]["reward_s"] > 0
        assert all(exp["rewards"][k] > 0 for k in ("awaiting", "leased", "scored", "timed_out"))

        resp = await accounting_api.get(f"/v1/runs/{sim.run_id}/accounting")
        assert resp.status_code == 200, resp.text
        got = resp.json()
        assert_matches(got, exp)
        assert got["pending_events"] == 0
        assert got["as_of"] is not None
        # The invariants of SPEC.md, on the API's own numbers.
        assert got["rollouts_received"] == (
            got["buffered"] + got["leased"] + sum(got["retired"].values())
        )
        assert got["reuse_factor"] == got["samples_consumed"] / got["rollouts_received"]
        prompts = got["prompts"]
        assert prompts["registered"] == (
            prompts["queued"] + prompts["in_flight"] + prompts["done"] + prompts["failed"]
        )

        listed: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"limit": 7, **({"cursor": cursor} if cursor else {})}
            page = (
                await accounting_api.get(f"/v1/runs/{sim.run_id}/prompts", params=params)
            ).json()
            listed.extend(page["prompts"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert listed == sim.expected_passes()
        assert len(listed) == prompts["registered"]
        # Each prompt's newest group mean and the groups told (`prompt_scored`).
        async with sessionmaker() as s:
            rows = await s.scalars(select(PromptMean).where(PromptMean.run_id == sim.run_id))
            assert {r.prompt_id: (r.mean, r.groups) for r in rows.all()} == sim.means
        assert any(groups > 1 for _, groups in sim.means.values())

        ledger: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 25}
            if cursor:
                params["cursor"] = cursor
            page = (
                await accounting_api.get(f"/v1/runs/{sim.run_id}/batches", params=params)
            ).json()
            ledger.extend(page["batches"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert len(ledger) == len(sim.batches) == got["batches"]["leased"]
        assert [b["batch_id"] for b in ledger] == list(sim.batches)  # lease order
        assert got["samples_consumed"] == sum(b["size"] for b in ledger if b["outcome"] == "acked")
        for b in ledger:
            assert b["outcome"] == sim.batches[b["batch_id"]].outcome
            assert (b["rewound_at"] is not None) == sim.batches[b["batch_id"]].rewound
            assert b["size"] == len(sim.batches[b["batch_id"]].rollout_ids)

        versions = (await accounting_api.get(f"/v1/runs/{sim.run_id}/accounting/versions")).json()
        rows = {v["policy_version"]: v for v in versions["versions"]}
        expected_versions = sim.expected_versions()
        assert set(rows) == set(expected_versions)
        for v, exp_v in expected_versions.items():
            assert_matches(rows[v], exp_v)
        for name in SUMMED:
            assert sum(r[name] for r in rows.values()) == got[name], name
        for kind in ("rejected", "retired"):
            summed: dict[str, int] = {}
            for r in rows.values():
                for reason, n in r[kind].items():
                    summed[reason] = summed.get(reason, 0) + n
            assert summed == got[kind]
        histogram: dict[str, int] = {}
        for r in rows.values():
            for lag, n in r["lag"]["histogram"].items():
                histogram[lag] = histogram.get(lag, 0) + n
        assert histogram == got["lag"]["histogram"]

    # The stored per-version counters (a separate accumulation) sum to the run's counters,
    # and the run's prompt-pass counters (kept from each row's change) count the ledger's rows.
    async with sessionmaker() as s:
        for sim in sims:
            run = await s.get(RunTotals, sim.run_id)
            assert run is not None
            assert await _counted_passes(s, sim.run_id) == _pass_counters(run)
            for column in VersionTotals.__table__.columns:
                if column.key in NOT_ADDITIVE:
                    continue
                total = await s.scalar(
                    select(func.sum(column)).where(VersionTotals.run_id == sim.run_id)
                )
                assert total == getattr(run, column.key), column.key


async def test_redelivery_changes_nothing(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    sim = RunSim(run_id, seed=3, group_size=2, rewinds=True)
    sim.workload(40)
    assert "rewound" in {t for t, _ in sim.events}
    await register_run(redis, prefix, run_id)
    ids = await xadd_events(redis, prefix, run_id, sim.events)
    key = events_key(prefix, run_id)

    # Keep the entries in the stream so they can be delivered again.
    first = make_ctx(trim=False, batch_size=50)
    await drain_all(first)
    before = await _snapshot(sessionmaker, run_id)
    assert before["processed"] == len(ids)

    # 1. The group forgets everything: every entry is delivered a second time.
    await redis.xgroup_setid(key, CONSUMER_GROUP, "0")
    await drain_all(make_ctx(trim=False, batch_size=64))
    assert await _snapshot(sessionmaker, run_id) == before

    # 2. A consumer reads entries and dies before acknowledging; a second one claims them.
    await redis.xgroup_setid(key, CONSUMER_GROUP, "0")
    ghost = await redis.xreadgroup(CONSUMER_GROUP, "ghost", {key: ">"}, count=len(ids) // 2)
    assert len(ghost[0][1]) == len(ids) // 2
    claimer = make_ctx(trim=False, claim_idle_ms=0)
    counts = await drain_once(claimer, claim=True)
    assert counts.already == counts.read == len(ids) and counts.applied == 0
    assert await _snapshot(sessionmaker, run_id) == before

    # 3. Committed to Postgres but never acknowledged (the crash window), then drained.
    await redis.xgroup_setid(key, CONSUMER_GROUP, "0")
    raw = await redis.xreadgroup(CONSUMER_GROUP, "ghost2", {key: ">"}, count=10)
    events = [decode_entry(run_id, eid, fields) for eid, fields in raw[0][1]]
    async with sessionmaker() as s, s.begin():
        result = await repository.apply_events(s, run_id, events)
    assert result.applied == 0 and result.already == 10
    await drain_all(make_ctx(trim=False, claim_idle_ms=0), claim=True)
    assert await _snapshot(sessionmaker, run_id) == before
    assert (await redis.xpending(key, CONSUMER_GROUP))["pending"] == 0

    # 3b. A consumer restarted under its old name reads its own pending entries first, long
    #     before they would be idle enough for anyone to claim them.
    await redis.xgroup_setid(key, CONSUMER_GROUP, "0")
    await redis.xreadgroup(CONSUMER_GROUP, "fixed-name", {key: ">"}, count=7)
    reborn = make_ctx(consumer="fixed-name", trim=False, claim_idle_ms=3_600_000)
    counts = await drain_once(reborn, claim=False)
    assert counts.read >= 7 and counts.already >= 7
    assert (await redis.xpending(key, CONSUMER_GROUP))["pending"] == 0
    assert await _snapshot(sessionmaker, run_id) == before

    # 4. The same entries twice in one batch apply once.
    async with sessionmaker() as s, s.begin():
        dup_events = [*events, *events]
        result = await repository.apply_events(s, run_id, dup_events)
    assert result.applied == 0
    assert await _snapshot(sessionmaker, run_id) == before


async def test_poison_entry_is_dead_lettered_and_does_not_block(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    sim = RunSim(run_id, seed=4)
    sim.workload(5)
    await register_run(redis, prefix, run_id)
    key = events_key(prefix, run_id)
    good_before = await xadd_events(redis, prefix, run_id, sim.events)
    bad = [
        await redis.xadd(key, {b"e": b"accepted", b"d": b"\xc1not msgpack"}),
        await redis.xadd(key, entry("accepted", {"t": 1, "items": [["r", "r", 0, "many", 1]]})),
        await redis.xadd(key, entry("retired", {"t": 1, "reason": "kl", "items": [[1, 2]]})),
        await redis.xadd(key, {b"e": b"teleported", b"d": pack({"t": 1})}),
        await redis.xadd(
            key,
            entry(
                "acked",
                {
                    "t": 1,
                    "batch_id": "b",
                    "policy_version": 0,
                    "items": [],
                    "sums": {"kl_sum": float("nan")},
                },
            ),
        ),
        await redis.xadd(key, {b"d": pack({"t": 1})}),
    ]
    later = RunSim(run_id, seed=5)
    later.ingest(3)
    good_after = await xadd_events(redis, prefix, run_id, later.events)

    ctx = make_ctx(max_deliveries=3)
    first = await drain_once(ctx)
    # Everything around the poison was applied on the first delivery.
    assert first.applied == len(good_before) + len(good_after)
    assert first.retrying == len(bad) and first.dead == 0
    async with sessionmaker() as s:
        applied = await repository.processed_ids(s, run_id)
    assert {StreamId.parse(i) for i in good_before + good_after} == applied

    dead = 0
    passes = 1
    while dead < len(bad):
        counts = await drain_once(ctx)
        passes += 1
        dead += counts.dead
        assert counts.applied == 0
        assert passes <= 3, "dead-lettered later than max_deliveries"
    assert passes == 3  # exactly at the bound: deliveries 1, 2, 3
    assert (await redis.xpending(key, CONSUMER_GROUP))["pending"] == 0

    dead_entries = await redis.xrange(dead_key(prefix, run_id))
    assert [f[b"dead.id"] for _, f in dead_entries] == bad
    assert dead_entries[0][1][b"d"] == b"\xc1not msgpack"
    assert all(f[b"dead.deliveries"] == b"3" for _, f in dead_entries)

    resp = await accounting_api.get(
        f"/v1/runs/{run_id}/accounting/dead-letters", params={"limit": 4}
    )
    assert resp.status_code == 200
    page = resp.json()
    assert page["count"] == len(bad)
    assert [d["stream_id"] for d in page["dead_letters"]] == [b.decode() for b in bad[:4]]
    assert "not msgpack" in page["dead_letters"][0]["error"]
    assert page["dead_letters"][3]["event"] == "teleported"
    rest = (
        await accounting_api.get(
            f"/v1/runs/{run_id}/accounting/dead-letters", params={"cursor": page["next_cursor"]}
        )
    ).json()
    assert [d["stream_id"] for d in rest["dead_letters"]] == [b.decode() for b in bad[4:]]
    assert rest["dead_letters"][-1]["event"] is None and rest["next_cursor"] is None

    # The dead letters are not in the totals; the rest is.
    acct = (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert acct["rollouts_received"] == len(sim.rollouts) + len(later.rollouts)
    assert acct["pending_events"] == 0


async def test_trim_keeps_unacknowledged_entries(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    sim = RunSim(run_id, seed=6)
    sim.workload(30)
    events = sim.events
    third = len(events) // 3
    await register_run(redis, prefix, run_id)
    key = events_key(prefix, run_id)
    ctx = make_ctx(batch_size=20)

    first = await xadd_events(redis, prefix, run_id, events[:third])
    await drain_all(ctx)
    assert await redis.xlen(key) == 0  # all acknowledged: all trimmed

    # A consumer takes entries and never acknowledges them; more arrive behind it.
    second = await xadd_events(redis, prefix, run_id, events[third : 2 * third])
    taken = await redis.xreadgroup(CONSUMER_GROUP, "stalled", {key: ">"}, count=5)
    held = [eid for eid, _ in taken[0][1]]
    assert held == second[:5]
    await drain_all(ctx)
    remaining = [eid for eid, _ in await redis.xrange(key)]
    # Nothing below the oldest pending entry survives; the pending ones and all after stay.
    assert remaining == second
    pending = await redis.xpending_range(key, CONSUMER_GROUP, "-", "+", 100)
    assert [p["message_id"] for p in pending] == held

    # Entries not yet delivered to the group are never trimmed.
    third_ids = await xadd_events(redis, prefix, run_id, events[2 * third :])
    assert await ctx.drainer.stream.trim_acknowledged(run_id) == 0
    assert [eid for eid, _ in await redis.xrange(key)] == second + third_ids

    # Once the stalled entries are claimed and drained, the stream empties.
    claimer = make_ctx(claim_idle_ms=0)
    await drain_all(claimer, claim=True)
    assert await redis.xlen(key) == 0
    async with sessionmaker() as s:
        applied = await repository.processed_ids(s, run_id)
        assert await s.scalar(
            select(func.count()).select_from(ProcessedEvent).where(ProcessedEvent.run_id == run_id)
        ) == len(events)
    assert applied == {StreamId.parse(i) for i in first + second + third_ids}
    totals = (await _snapshot(sessionmaker, run_id))["run_totals"][0]
    assert totals["rollouts_received"] == len(sim.rollouts)


async def test_event_refused_by_postgres_is_isolated(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """An event that decodes but that Postgres refuses (here: a counter past int64) fails
    alone: the batch is retried event by event and only that one is dead-lettered."""
    await register_run(redis, prefix, run_id)
    key = events_key(prefix, run_id)
    huge = 2**62

    def accepted(rid: str, tokens: int) -> dict[bytes, bytes]:
        return entry("accepted", {"t": 5, "items": [[rid, rid, 0, tokens, 1]]})

    first = await redis.xadd(key, accepted("a", huge))
    overflow = await redis.xadd(key, accepted("b", huge))  # a + b > 2**63 - 1
    last = await redis.xadd(key, accepted("c", 7))

    ctx = make_ctx(max_deliveries=2)
    counts = await drain_once(ctx)
    assert (counts.applied, counts.retrying) == (2, 1)
    counts = await drain_once(ctx)
    assert (counts.applied, counts.dead) == (0, 1)
    assert [f[b"dead.id"] for _, f in await redis.xrange(dead_key(prefix, run_id))] == [overflow]
    assert (
        "out of range"
        in (await redis.xrange(dead_key(prefix, run_id)))[0][1][b"dead.error"].decode()
    )
    async with sessionmaker() as s:
        assert await repository.processed_ids(s, run_id) == {
            StreamId.parse(first),
            StreamId.parse(last),
        }
        totals = await s.get(RunTotals, run_id)
        assert totals is not None
        assert (totals.rollouts_received, totals.tokens_generated) == (2, huge + 7)
    assert await redis.xlen(key) == 0
