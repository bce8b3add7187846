"""Consumers of kind preferences in the accounting (SPEC "Consumers", "Accounting"): their items
are pairs, so the 'consumers' events count pairs delivered, acked and dropped (retention,
max_lag, deletion), and ``consumer_totals`` ends with exactly the pairs each consumer's live
counters saw."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from test_consumer_accounting import _checked, _lease

from app.accounting.models import ConsumerTotals
from app.broker.config import RunConfig
from app.broker.store import RedisStore
from tests.broker.test_prompt_scripts import _acked
from tests.broker.test_store import lease, packed
from workers.drain import DrainContext

# The ledger is the subject; the consumer scripts' keys are a run's, the same on a cluster.
pytestmark = pytest.mark.one_node


def group(gid: str, version: int = 0) -> list:
    """A group of three with rewards 0, 1, 2: three pairs under `all`, one under best_worst."""
    return [packed(f"{gid}{i}", version, group=gid, reward=float(i)) for i in range(3)]


async def test_pair_counts_reach_consumer_totals_exactly(
    store: RedisStore,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    cfg = RunConfig(group_size=3, max_staleness=5)
    assert await store.create_run(run_id, cfg) == "created"

    async def create(name: str, source: str, pairs: str, **kw: int) -> None:
        await store.create_consumer(
            run_id, name, kind="preferences", source=source, min_margin=0.0, pairs=pairs, **kw
        )

    async def check(*names: str) -> dict[str, dict[str, int]]:
        return await _checked(store, run_id, make_ctx(), accounting_api, *names)

    await create("all", "received", "all", retention_rollouts=4, max_lag=0)
    await create("bw", "received", "best_worst")
    await create("tr", "trained", "all")
    await store.ingest(run_id, group("a"))
    await store.ingest(run_id, group("b"))  # all: 6 pairs, 2 beyond its retention
    await store.consumer_ack(run_id, "all", await _lease(store, run_id, "all", 1))
    await store.consumer_nack(run_id, "all", await _lease(store, run_id, "all", 2))
    await _lease(store, run_id, "bw", 1)  # stays leased: pending in the ledger
    got = await lease(store, 3, run_id=run_id)
    # Group a's first use, with the acked event the ledger applies: tr's 3 pairs.
    await store.ack(run_id, got.batch_id, kl_mean=None, event=_acked(got), stats_text="{}")
    ledger = await check("all", "bw", "tr")
    assert ledger["all"] == {"delivered": 6, "acked": 1, "pending": 3, "dropped": 2}
    assert ledger["bw"] == {"delivered": 2, "acked": 0, "pending": 2, "dropped": 0}
    assert ledger["tr"] == {"delivered": 3, "acked": 0, "pending": 3, "dropped": 0}

    # Version 1: every pair of version 0 is beyond max_lag 0 when handed out.
    await store.set_policy(run_id, 1)
    await store.ingest(run_id, group("c", 1))
    await store.consumer_ack(run_id, "all", await _lease(store, run_id, "all", 10))
    assert await store.delete_consumer(run_id, "bw")  # a leased pair and two pending
    ledger = await check("all", "tr")
    assert ledger["all"] == {"delivered": 9, "acked": 4, "pending": 0, "dropped": 5}
    assert ledger["bw"] == {"delivered": 3, "acked": 0, "pending": 0, "dropped": 3}

    async with sessionmaker() as s:
        rows = await s.scalars(select(ConsumerTotals).where(ConsumerTotals.run_id == run_id))
        totals = {r.name: (r.delivered, r.acked, r.dropped) for r in rows.all()}
    assert totals == {"all": (9, 4, 5), "bw": (3, 0, 3), "tr": (3, 0, 0)}
