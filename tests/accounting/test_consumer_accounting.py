"""Consumers in the accounting (SPEC "Consumers", "Accounting"): a store-level run with
consumers, drained into Postgres, answers each consumer's delivered, acked and dropped as its
live counters say and pending as its pending and leased items; the figures fold in any order."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from accounting_helpers import RunSim, drain_all, entry
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.broker.config import RunConfig
from app.broker.store import RedisStore
from app.events import Event, decode_entry
from tests.broker.test_store import packed
from workers.drain import DrainContext

# The ledger is the subject; the consumer scripts' keys are a run's, the same on a cluster.
pytestmark = pytest.mark.one_node


async def _ledger(api: httpx.AsyncClient, run_id: str) -> dict[str, dict[str, int]]:
    resp = await api.get(f"/v1/runs/{run_id}/accounting")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["pending_events"] == 0 and body["dead_letters"] == 0
    consumers: dict[str, dict[str, int]] = body["consumers"]
    return consumers


async def _live(store: RedisStore, run_id: str, name: str) -> dict[str, int]:
    """The consumer's live counters (its counter hash), pending = its queue's ZCARD + leased."""
    v = await store.get_consumer(run_id, name)
    assert v is not None
    return {
        "delivered": v.delivered,
        "acked": v.acked,
        "pending": v.pending + v.leased,
        "dropped": v.dropped,
    }


async def _checked(
    store: RedisStore, run_id: str, ctx: DrainContext, api: httpx.AsyncClient, *names: str
) -> dict[str, dict[str, int]]:
    """The ledger after a drain, each of ``names`` checked against its live counters."""
    await drain_all(ctx)
    ledger = await _ledger(api, run_id)
    for name in names:
        assert ledger[name] == await _live(store, run_id, name), name
    return ledger


async def _lease(store: RedisStore, run_id: str, name: str, size: int) -> str:
    bid = uuid.uuid4().hex
    got = await store.consumer_lease(run_id, name, batch_id=bid, size=size, lease_ms=60_000)
    assert got is not None
    return bid


async def test_the_ledger_equals_the_live_counters_through_a_deletion(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
) -> None:
    store = RedisStore(redis, prefix)
    assert await store.create_run(run_id, RunConfig()) == "created"

    async def check(*names: str) -> dict[str, dict[str, int]]:
        return await _checked(store, run_id, make_ctx(), accounting_api, *names)

    await drain_all(make_ctx())
    assert await _ledger(accounting_api, run_id) == {}  # none: an empty map
    await store.create_consumer(run_id, "c", source="received", max_lag=1, retention_rollouts=3)
    await store.create_consumer(run_id, "d", source="received")
    zero = {"delivered": 0, "acked": 0, "pending": 0, "dropped": 0}
    assert await check("c", "d") == {"c": zero, "d": zero}  # listed before any item
    await store.ingest(run_id, [packed(f"a{i}") for i in range(5)])  # c keeps 3 of 5
    await store.consumer_ack(run_id, "c", await _lease(store, run_id, "c", 1))
    await store.consumer_nack(run_id, "c", await _lease(store, run_id, "c", 1))
    await _lease(store, run_id, "d", 2)  # stays leased: pending in the ledger
    ledger = await check("c", "d")
    assert ledger["c"] == {"delivered": 5, "acked": 1, "pending": 2, "dropped": 2}
    assert ledger["d"] == {"delivered": 5, "acked": 0, "pending": 5, "dropped": 0}

    # Version 2: c's two items of version 0 are beyond its max_lag when leased (dropped).
    await store.set_policy(run_id, 2)
    await store.ingest(run_id, [packed("b", 2)])
    await _lease(store, run_id, "c", 5)  # b, left leased
    ledger = await check("c", "d")
    assert ledger["c"] == {"delivered": 6, "acked": 1, "pending": 1, "dropped": 4}

    # Its deletion drops what it held (b, leased); a consumer created again under the same
    # name adds to the same figures.
    await store.ingest(run_id, [packed("e", 2)])  # pending beside the lease
    assert await store.delete_consumer(run_id, "c")
    ledger = await check("d")
    assert ledger["c"] == {"delivered": 7, "acked": 1, "pending": 0, "dropped": 6}
    await store.create_consumer(run_id, "c", source="received")
    await store.ingest(run_id, [packed("f", 2)])
    ledger = await check("d")
    assert ledger["c"] == {"delivered": 8, "acked": 1, "pending": 1, "dropped": 6}
    assert await _live(store, run_id, "c") == {
        "delivered": 1,
        "acked": 0,
        "pending": 1,
        "dropped": 0,
    }


def _events(run_id: str, raw: list[tuple[str, dict[str, Any]]]) -> list[Event]:
    return [decode_entry(run_id, f"{1000 + i}-0", entry(t, p)) for i, (t, p) in enumerate(raw)]


@pytest.mark.parametrize("order", ["in_order", "one_at_a_time_shuffled", "batches_shuffled"])
async def test_consumer_figures_fold_in_any_order(
    sessionmaker: async_sessionmaker[AsyncSession],
    accounting_api: httpx.AsyncClient,
    run_id: str,
    order: str,
) -> None:
    sim = RunSim(run_id, seed=9, group_size=2)
    sim.workload(30)
    events = _events(run_id, sim.events)
    assert sum(e.type == "consumers" for e in events) >= 5
    if order == "in_order":
        batches: list[list[Event]] = [events]
    elif order == "one_at_a_time_shuffled":
        batches = [[e] for e in events]
        random.Random(3).shuffle(batches)
    else:
        batches = [events[i : i + 7] for i in range(0, len(events), 7)]
        random.Random(4).shuffle(batches)
    for batch in batches:
        async with sessionmaker() as s, s.begin():
            await repository.apply_events(s, run_id, batch)
    want = sim.expected_consumers()
    assert len(want) >= 2
    assert await _ledger(accounting_api, run_id) == want
