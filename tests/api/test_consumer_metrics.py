"""The per-consumer figures of ``GET /metrics`` (SPEC "Consumers"): each consumer's delivered,
acked, pending and dropped items as the run's accounting answers them, driven through the
store's consumer calls and drained; and a bounded set of ``consumer`` labels, the rest summed
under ``(other)``."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting.schemas import ConsumerCounts
from app.broker.store import RedisStore
from app.events import ConsumerItem, ConsumersChanged
from app.events import Event as StreamEvent
from app.ids import CONSUMER_NAME_PATTERN
from app.metrics.consumers import OTHER_CONSUMERS, label_consumers
from app.settings import Settings
from tests.accounting.accounting_helpers import apply_batches, event_at
from tests.api.test_metrics import Samples, app_client, scrape
from tests.helpers import make_run, post, rollout
from workers.drain import DrainContext, drain_once


def consumers_in(samples: Samples, run: str) -> dict[str, dict[str, float]]:
    """consumer label -> state -> value of the run's ``rollout_broker_consumer_items``."""
    out: dict[str, dict[str, float]] = {}
    for (name, key), v in samples.items():
        labels = dict(key)
        if name == "rollout_broker_consumer_items" and labels["run"] == run:
            out.setdefault(labels["consumer"], {})[labels["state"]] = v
    return out


async def test_consumer_items_equal_the_accounting(
    api: httpx.AsyncClient, store: RedisStore, redis, prefix, sessionmaker
) -> None:
    """Two consumers driven through the store: one keeps 3 of 5 (retention), acks one and
    leaves one leased; the other holds all 5. The scrape says what GET .../accounting says."""
    drain = DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain")
    await make_run(api, "cm1")
    await drain_once(drain)
    assert consumers_in(await scrape(api), "cm1") == {}  # none yet: no series
    await store.create_consumer("cm1", "rm", source="received", retention_rollouts=3)
    await store.create_consumer("cm1", "dpo", source="received")
    assert (await post(api, "cm1", *(rollout(f"a{i}") for i in range(5)))).status_code == 202
    for settle in (store.consumer_ack, None):
        bid = uuid.uuid4().hex
        got = await store.consumer_lease("cm1", "rm", batch_id=bid, size=1, lease_ms=60_000)
        assert got is not None and len(got.rollout_ids) == 1
        if settle is not None:
            await settle("cm1", "rm", bid)
    await drain_once(drain)

    acc = (await api.get("/v1/runs/cm1/accounting")).json()
    assert acc["pending_events"] == 0
    got = consumers_in(await scrape(api), "cm1")
    assert got == acc["consumers"]
    assert got == {
        "rm": {"delivered": 5, "acked": 1, "pending": 2, "dropped": 2},
        "dpo": {"delivered": 5, "acked": 0, "pending": 5, "dropped": 0},
    }

    # A deleted consumer keeps its figures (what it held, dropped) while the run is open.
    assert await store.delete_consumer("cm1", "dpo")
    await drain_once(drain)
    got = consumers_in(await scrape(api), "cm1")
    assert got["dpo"] == {"delivered": 5, "acked": 0, "pending": 0, "dropped": 5}


def _told(n: int, *items: tuple[str, int, int, int]) -> StreamEvent:
    return event_at("cb1", n, "consumers", ConsumersChanged(tuple(ConsumerItem(*i) for i in items)))


async def test_consumer_labels_stay_bounded_and_the_rest_is_summed_under_other(
    settings: Settings, sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    async with app_client(settings.model_copy(update={"metrics_consumers": 2})) as c:
        await make_run(c, "cb1")
        # name, delivered, acked, dropped
        await apply_batches(
            sessionmaker,
            "cb1",
            [[_told(1, ("a", 9, 4, 1), ("b", 7, 7, 0), ("c", 7, 2, 3), ("d", 2, 0, 1))]],
        )
        assert consumers_in(await scrape(c), "cb1") == {
            "a": {"delivered": 9, "acked": 4, "pending": 4, "dropped": 1},
            "b": {"delivered": 7, "acked": 7, "pending": 0, "dropped": 0},  # b before c
            OTHER_CONSUMERS: {"delivered": 9, "acked": 2, "pending": 3, "dropped": 4},
        }
        # d overtakes a and b: it takes a label, b joins the sum.
        await apply_batches(sessionmaker, "cb1", [[_told(2, ("d", 20, 0, 0))]])
        assert consumers_in(await scrape(c), "cb1") == {
            "d": {"delivered": 22, "acked": 0, "pending": 21, "dropped": 1},
            "a": {"delivered": 9, "acked": 4, "pending": 4, "dropped": 1},
            OTHER_CONSUMERS: {"delivered": 14, "acked": 9, "pending": 2, "dropped": 3},
        }


@pytest.mark.parametrize("bound", [0, 4])
def test_label_consumers_sums_all_or_none(bound: int) -> None:
    assert re.fullmatch(CONSUMER_NAME_PATTERN, OTHER_CONSUMERS) is None  # never a consumer's
    counts = {n: ConsumerCounts(delivered=3, acked=1, pending=1, dropped=1) for n in "xyz"}
    got = dict(label_consumers(counts, bound))
    if bound == 0:
        assert got == {OTHER_CONSUMERS: ConsumerCounts(delivered=9, acked=3, pending=3, dropped=3)}
    else:
        assert got == counts  # none left over: no (other) series
