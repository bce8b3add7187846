"""Difficulty pools in the ledger: each prompt's newest group mean folded from `prompt_scored`
events whatever the order and batching, passes `skipped` counted, and the pools read from the
means and the run's current thresholds, in the accounting and in the prompts listing."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from accounting_helpers import (
    T0,
    apply_batches,
    drain_all,
    event_at,
    register_run,
    xadd_events,
)
from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import queries
from app.accounting.models import PromptMean
from app.accounting.schemas import RunAccounting
from app.accounting.stream import EventStream
from app.events import (
    Event,
    PassesChanged,
    PassItem,
    PromptScored,
    PromptScoredItem,
    Registered,
    RegisteredItem,
    RunChanged,
    WorkItem,
    WorkLeased,
    encode_payload,
)
from app.metrics import CATALOGUE
from app.metrics.broker import LedgerFigures, _BrokerCollector, _family
from workers.drain import DrainContext

# The fold and the ledger's reads are the subject here; Redis serves only the stream and the
# reads' pending counts, the same on a cluster (the drain's own tests run on both).
pytestmark = pytest.mark.one_node


def _scored_workload(run_id: str, seed: int) -> tuple[list[Event], dict[str, tuple[float, int]]]:
    """`prompt_scored` events of several items each, a prompt told many times across them;
    and what the ledger must hold: per prompt the newest event's mean and the groups told."""
    rng = random.Random(seed)
    prompts = [f"p{i:02d}" for i in range(12)]
    events, expected = [], {}
    for n in range(1, 41):
        told = rng.sample(prompts, rng.randint(1, 4))
        items = tuple(PromptScoredItem(p, round(rng.uniform(-1, 1), 6), 4) for p in told)
        events.append(event_at(run_id, n, "prompt_scored", PromptScored(items)))
        for item in items:
            groups = expected.get(item.prompt_id, (0.0, 0))[1]
            expected[item.prompt_id] = (item.mean, groups + 1)
    return events, expected


async def _means(sm: async_sessionmaker[AsyncSession], run_id: str) -> dict[str, tuple[float, int]]:
    async with sm() as s:
        rows = await s.scalars(select(PromptMean).where(PromptMean.run_id == run_id))
        return {row.prompt_id: (row.mean, row.groups) for row in rows.all()}


@pytest.mark.parametrize(
    "order", ["in_order", "one_at_a_time_shuffled", "batches_shuffled", "reversed"]
)
async def test_the_newest_mean_wins_and_groups_add_up_whatever_the_order(
    sessionmaker: async_sessionmaker[AsyncSession], run_id: str, order: str
) -> None:
    events, expected = _scored_workload(run_id, seed=7)
    if order == "in_order":
        batches: list[list[Event]] = [events]
    elif order == "one_at_a_time_shuffled":
        batches = [[e] for e in events]
        random.Random(3).shuffle(batches)
    elif order == "batches_shuffled":
        batches = [events[i : i + 7] for i in range(0, len(events), 7)]
        random.Random(4).shuffle(batches)
    else:
        batches = [[e] for e in reversed(events)]
    await apply_batches(sessionmaker, run_id, batches)
    assert await _means(sessionmaker, run_id) == expected
    # Applied again (a batch delivered twice): nothing changes.
    await apply_batches(sessionmaker, run_id, [events[:5]])
    assert await _means(sessionmaker, run_id) == expected


EASY_ABOVE, HARD_BELOW = 0.6, 0.2


def _config(difficulty: dict[str, Any] | None) -> dict[str, Any]:
    return {"group_size": 2, "difficulty": difficulty}


def _difficulty(easy_above: float, hard_below: float) -> dict[str, Any]:
    return {
        "easy_above": easy_above,
        "hard_below": hard_below,
        "weights": {"easy": 0.0, "normal": 1.0, "hard": 2.0},
    }


def _run(run_id: str, n: int, change: str, difficulty: dict[str, Any] | None) -> Event:
    body = RunChanged(run_id, change, _config(difficulty), 0, "open", T0)
    return event_at(run_id, n, "run", body)


def _pool(mean: float | None, easy_above: float, hard_below: float) -> str:
    if mean is None:
        return "normal"
    return "easy" if mean > easy_above else "hard" if mean < hard_below else "normal"


# Means of prompts p00..p09 (p10, p11 never scored): on and beside each threshold.
MEANS = [0.9, 0.6, 0.61, 0.4, 0.2, 0.19, -0.5, 0.6000001, 0.0, 1.0]
# (prompt, pass) -> final state given by a `passes` event; every other pass stays queued.
ENDED = {("p00", 1): "skipped", ("p00", 2): "skipped", ("p03", 1): "done", ("p06", 1): "failed"}


def _pools_workload(run_id: str) -> tuple[list[Event], dict[tuple[str, int], str]]:
    """A run with difficulty: 12 prompts of 2 passes, 10 of them scored, some passes skipped,
    done, failed or in a work lease; and each pass's state."""
    prompts = [f"p{i:02d}" for i in range(12)]
    states = {(p, n): "queued" for p in prompts for n in (1, 2)}
    events = [
        _run(run_id, 1, "created", _difficulty(EASY_ABOVE, HARD_BELOW)),
        event_at(run_id, 2, "registered", Registered(tuple(RegisteredItem(p, 2) for p in prompts))),
    ]
    # An older mean of every scored prompt first, which the newer one below must replace.
    old = tuple(PromptScoredItem(p, 0.4, 2) for p in prompts[:10])
    events.append(event_at(run_id, 3, "prompt_scored", PromptScored(old)))
    new = tuple(PromptScoredItem(p, m, 2) for p, m in zip(prompts, MEANS, strict=False))
    events.append(event_at(run_id, 4, "prompt_scored", PromptScored(new)))
    lease = WorkLeased("w-1", "gen", 0, T0 + 60_000, (WorkItem("p01", 1, 1), WorkItem("p09", 2, 1)))
    events.append(event_at(run_id, 5, "work_leased", lease))
    states[("p01", 1)] = states[("p09", 2)] = "in_flight"
    items = tuple(PassItem(p, n, 1, state, 0) for (p, n), state in sorted(ENDED.items()))
    events.append(event_at(run_id, 6, "passes", PassesChanged("skipped", None, items)))
    states.update(ENDED)
    return events, states


def _want_pools(
    states: dict[tuple[str, int], str], easy_above: float, hard_below: float
) -> dict[str, int]:
    means = dict(zip((f"p{i:02d}" for i in range(10)), MEANS, strict=True))
    pools = dict.fromkeys(("easy", "normal", "hard"), 0)
    for (prompt, _), state in states.items():
        if state == "queued":
            pools[_pool(means.get(prompt), easy_above, hard_below)] += 1
    return pools


async def _accounting(api: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    resp = await api.get(f"/v1/runs/{run_id}/accounting")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["pending_events"] == 0
    return dict(body["prompts"])


async def test_skipped_passes_and_queued_pools_in_the_accounting(
    sessionmaker: async_sessionmaker[AsyncSession],
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
) -> None:
    events, states = _pools_workload(run_id)
    await register_run(redis, prefix, run_id)
    raw = [(e.type, encode_payload(e.type, e.body, t_ms=e.t_ms)) for e in events]
    await xadd_events(redis, prefix, run_id, raw)
    await drain_all(make_ctx(batch_size=3))

    prompts = await _accounting(accounting_api, run_id)
    pools = _want_pools(states, EASY_ABOVE, HARD_BELOW)
    assert pools == {"easy": 5, "normal": 8, "hard": 5}  # counted by hand
    assert prompts == {
        "registered": 24,
        "queued": 18,
        "in_flight": 2,
        "done": 3,  # one done, two skipped
        "failed": 1,
        "retried": 0,
        "skipped": 2,
        "cancelled": 0,
        "pools": pools,
    }
    assert prompts["registered"] == sum(
        prompts[k] for k in ("queued", "in_flight", "done", "failed")
    )
    # The read of several runs at once (GET /metrics) answers the same.
    async with sessionmaker() as s:
        read = await queries.checked_accounting_of(s, EventStream(redis, prefix), [run_id])
    assert read[run_id].accounting.prompts.model_dump() == prompts
    # GET /metrics: each pass in one state (done without the skipped), and the pools.
    passes, pools_of = _scraped(read[run_id].accounting, run_id)
    assert passes == {"queued": 18, "in_flight": 2, "done": 1, "failed": 1, "skipped": 2}
    assert pools_of == prompts["pools"]

    # New thresholds (a PATCH: the `run` event's config) move prompts between pools at once.
    await xadd_events(
        redis, prefix, run_id, [("run", _raw_run(run_id, "config", _difficulty(0.95, -0.6)))]
    )
    await drain_all(make_ctx())
    moved = await _accounting(accounting_api, run_id)
    assert moved["pools"] == _want_pools(states, 0.95, -0.6) != prompts["pools"]
    assert sum(moved["pools"].values()) == moved["queued"]

    # Difficulty turned off: no pools.
    await xadd_events(redis, prefix, run_id, [("run", _raw_run(run_id, "config", None))])
    await drain_all(make_ctx())
    assert (await _accounting(accounting_api, run_id))["pools"] is None


def _scraped(acc: RunAccounting, run_id: str) -> tuple[dict[str, float], dict[str, float]]:
    """The `prompt_passes` (by state) and `prompt_pool_passes` (by pool) the scrape shows."""
    families = {s.name: _family(s) for s in CATALOGUE if s.source != "process"}

    def put(name: str, value: float, *labels: str) -> None:
        families[f"rollout_broker_{name}"].add_metric(list(labels), value)

    _BrokerCollector._ledger(put, families, run_id, LedgerFigures(acc, {}, 0.0, False, {}))

    def by(name: str, label: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in families[f"rollout_broker_{name}"].samples}

    return by("prompt_passes", "state"), by("prompt_pool_passes", "pool")


def _raw_run(run_id: str, change: str, difficulty: dict[str, Any] | None) -> dict[str, Any]:
    body = RunChanged(run_id, change, _config(difficulty), 0, "open", T0)
    return encode_payload("run", body, t_ms=T0 + 100)


async def _pages(
    api: httpx.AsyncClient, run_id: str, limit: int, **params: str
) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        query: dict[str, Any] = {"limit": limit, **params}
        if cursor is not None:
            query["cursor"] = cursor
        resp = await api.get(f"/v1/runs/{run_id}/prompts", params=query)
        assert resp.status_code == 200, resp.text
        page = resp.json()
        assert len(page["prompts"]) <= limit
        assert page["next_cursor"] is None or len(page["prompts"]) == limit
        seen.extend(page["prompts"])
        cursor = page["next_cursor"]
        if cursor is None:
            return seen


async def test_prompts_listed_by_pool_and_state(
    sessionmaker: async_sessionmaker[AsyncSession],
    run_id: str,
    accounting_api: httpx.AsyncClient,
) -> None:
    events, states = _pools_workload(run_id)
    await apply_batches(sessionmaker, run_id, [events])
    means = dict(zip((f"p{i:02d}" for i in range(10)), MEANS, strict=True))
    everything = [
        {"prompt_id": p, "pass": n, "attempt": 1, "state": states[(p, n)], "tries": 0,
         "mean": means.get(p)}
        for p, n in sorted(states)
    ]  # fmt: skip
    assert await _pages(accounting_api, run_id, 1000) == everything
    for pool in ("easy", "normal", "hard"):
        want = [r for r in everything if _pool(r["mean"], EASY_ABOVE, HARD_BELOW) == pool]
        assert want, pool
        for limit in (1000, 3, 1):
            assert await _pages(accounting_api, run_id, limit, pool=pool) == want, (pool, limit)
        for state in ("queued", "skipped", "in_flight"):
            got = await _pages(accounting_api, run_id, 2, pool=pool, state=state)
            assert got == [r for r in want if r["state"] == state], (pool, state)
    skipped = await _pages(accounting_api, run_id, 1, state="skipped")
    assert [(r["prompt_id"], r["pass"]) for r in skipped] == [("p00", 1), ("p00", 2)]

    url = f"/v1/runs/{run_id}/prompts"
    for params in ({"pool": "medium"}, {"pool": ""}, {"pool": "Easy"}):
        resp = await accounting_api.get(url, params=params)
        assert resp.status_code == 422, params
        assert resp.json()["error"] == "ValidationFailed", params
    # A run without difficulty has no pools to filter by.
    await apply_batches(sessionmaker, run_id, [[_run(run_id, 50, "config", None)]])
    resp = await accounting_api.get(url, params={"pool": "normal"})
    assert resp.status_code == 422
    assert resp.json() == {
        "error": "ValidationFailed",
        "detail": f"pool needs a run with difficulty pools: run {run_id!r} has no difficulty",
    }
    # Without a pool it lists as before.
    assert await _pages(accounting_api, run_id, 5) == everything
    resp = await accounting_api.get("/v1/runs/no-such-run/prompts", params={"pool": "easy"})
    assert resp.status_code == 404
