"""Reward leases in the ledger: synthetic reward events drained from a real stream into Postgres
and shown by the accounting endpoints, then the real broker's reward leases drained and checked
against its live state in Redis (the ledger == live check over the rollouts awaiting a reward),
and the reward-latency histogram of ``GET /metrics``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from accounting_helpers import drain_all, register_run, xadd_events
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from rollout_broker_client._wire import parse_accounting
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.accounting import ledger
from app.accounting.deltas import REWARD_LATENCY_BOUNDS_MS
from app.accounting.models import RewardLatencyCount
from app.accounting.stream import EventStream
from app.events import (
    Accepted,
    AcceptedItem,
    Payload,
    Retired,
    RetiredItem,
    RewardExpired,
    RewardExpiredItem,
    RewardItem,
    RewardLeased,
    RewardReturned,
    Scored,
    ScoredItem,
    encode_payload,
)
from app.metrics.broker import _reward_latency_buckets
from tests.api.support import events
from tests.api.test_rewards import _expire as expire_reward_lease
from tests.api.test_rewards import reward_lease, score
from tests.helpers import live_of_ledger, make_run, post, rollout
from workers.drain import DrainContext


def _synthetic() -> list[tuple[str, Payload]]:
    """Five rollouts posted unscored at versions 0 and 1, and one with its reward: a scored
    lease, a score with no lease, a lease given back, expiries up to reward_timeout, and one
    rollout still in a live reward lease."""

    def items(*rids: str) -> tuple[RewardItem, ...]:
        return tuple(RewardItem(r, int(r[1]), 4) for r in rids)

    def expired(*rids: str, n: int) -> tuple[RewardExpiredItem, ...]:
        return tuple(RewardExpiredItem(r, int(r[1]), n) for r in rids)

    ids = ("a0", "b0", "c1", "d1", "e1")
    posted = tuple(AcceptedItem(r, r, int(r[1]), 4, True, 0, True) for r in ids)
    return [
        ("accepted", Accepted(posted)),
        ("accepted", Accepted((AcceptedItem("f0", "f0", 0, 4, True),))),
        ("reward_leased", RewardLeased("l1", "judge", 10**13, items("a0", "b0"), 40)),
        ("scored", Scored((ScoredItem("a0", 0, 1.0, 250, True),))),
        ("reward_returned", RewardReturned("l1", items("b0"))),
        ("scored", Scored((ScoredItem("c1", 1, 0.0, 4_000_000, False),))),  # beyond 30 min
        ("reward_leased", RewardLeased("l2", None, 10**13, items("b0", "d1"), None)),
        ("reward_expired", RewardExpired("l2", expired("b0", "d1", n=1))),
        ("reward_leased", RewardLeased("l3", None, 10**13, items("b0"), 0)),
        ("reward_expired", RewardExpired("l3", expired("b0", n=2))),
        ("retired", Retired("reward_timeout", (RetiredItem("b0", 0, 4, 0, 1),))),
        ("reward_leased", RewardLeased("l4", None, 10**13, items("e1"), 0)),
    ]  # fmt: skip


async def test_the_drain_applies_reward_events_and_the_endpoints_show_them(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    await register_run(redis, prefix, run_id)
    t = 1_750_000_000_000
    stream = [
        (kind, encode_payload(kind, body, t_ms=t + i))
        for i, (kind, body) in enumerate(_synthetic())
    ]
    await xadd_events(redis, prefix, run_id, stream)
    await drain_all(make_ctx(batch_size=3))

    acc = (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert acc["pending_events"] == 0 and acc["dead_letters"] == 0
    # d1 awaits again after its expiry, e1 is in l4; a0 and c1 were scored; b0 and d1 expired.
    assert acc["rewards"] == {"awaiting": 1, "leased": 1, "scored": 2, "timed_out": 3}
    assert acc["wait"]["reward_s"] == pytest.approx(4_000.25)
    assert acc["retired"] == {"reward_timeout": 1}
    assert acc["buffered"] == 5  # awaiting, reward-leased and scored rollouts are all buffered
    versions = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/versions")).json()
    by_version = {v["policy_version"]: v["rewards"] for v in versions["versions"]}
    assert by_version == {
        0: {"awaiting": 0, "leased": 0, "scored": 1, "timed_out": 2},
        1: {"awaiting": 1, "leased": 1, "scored": 1, "timed_out": 1},
    }
    async with sessionmaker() as s:
        rows = await s.execute(
            select(RewardLatencyCount.bound_ms, RewardLatencyCount.scores).where(
                RewardLatencyCount.run_id == run_id
            )
        )
        assert dict(rows.all()) == {500: 1}  # 4,000,000 ms is beyond the last bound


RUN = "rewarded"


async def _broker_run(api: httpx.AsyncClient) -> None:
    """The broker's reward leases: scored, given back, expired to reward_timeout, left live."""
    await make_run(api, RUN, max_reward_attempts=2)
    await post(api, RUN, *(rollout(f"w{i}", 0, reward=None) for i in range(6)), rollout("plain"))
    first = (await reward_lease(api, RUN, 2)).json()  # w0, w1
    assert (await score(api, RUN, {"w0": 0.5}, lease_id=first["lease_id"])).json()["scored"] == 1
    url = f"/v1/runs/{RUN}/rewards/lease/{first['lease_id']}/return"
    assert (await api.post(url, json={})).json() == {"returned": 1}
    assert (await score(api, RUN, {"w2": 1.0})).json()["scored"] == 1
    # Only the leases taken now run out (a slow machine would let the first expire too).
    assert (await api.patch(f"/v1/runs/{RUN}/config", json={"reward_timeout_s": 0.05})).is_success
    for attempt in range(2):  # w1 expires twice: reward_timeout
        lease_id = f"reward-lease-{attempt}"
        assert (await reward_lease(api, RUN, 1, lease_id=lease_id)).status_code == 200
        await expire_reward_lease(api, RUN, lease_id)
    assert (await api.patch(f"/v1/runs/{RUN}/config", json={"reward_timeout_s": 600})).is_success
    assert (await reward_lease(api, RUN, 1)).status_code == 200  # w3 leased; w4, w5 await


async def test_the_broker_s_reward_leases_are_accounted_and_agree_with_live(
    api: httpx.AsyncClient,
    make_ctx: Callable[..., DrainContext],
    redis: Redis,
    prefix: str,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    await _broker_run(api)
    waits = [i[3] for e, d in await events(redis, prefix, RUN) if e == "scored" for i in d["items"]]
    await drain_all(make_ctx())
    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()

    assert acc["pending_events"] == 0 and acc["dead_letters"] == 0
    assert acc["rewards"] == {"awaiting": 2, "leased": 1, "scored": 2, "timed_out": 2}
    assert acc["retired"] == {"reward_timeout": 1}
    assert acc["wait"]["reward_s"] == pytest.approx(sum(waits) / 1000)
    assert acc["live"] == live_of_ledger(acc)
    assert acc["live"]["rewards"] == {"awaiting": 2, "leased": 1}
    stream = EventStream(redis, prefix)
    async with sessionmaker() as session:
        check = await ledger.check_ledger(session, stream, RUN)
    assert check.settled and not check.mismatch

    # A reward lease the ledger never heard of: the live state says one more reward-leased.
    await redis.hincrby(keys.run_key(prefix, RUN), "rwl", 1)
    async with sessionmaker() as session:
        check = await ledger.check_ledger(session, stream, RUN)
    assert check.live is not None and check.live.rewards.model_dump() == {
        "awaiting": 1,
        "leased": 2,
    }
    assert check.mismatch
    # The client tells the two apart too.
    assert parse_accounting(acc).matches_live
    assert not parse_accounting((await api.get(f"/v1/runs/{RUN}/accounting")).json()).matches_live


async def test_the_metrics_show_the_reward_latency_histogram(
    api: httpx.AsyncClient, make_ctx: Callable[..., DrainContext], redis: Redis, prefix: str
) -> None:
    await _broker_run(api)
    waits = [i[3] for e, d in await events(redis, prefix, RUN) if e == "scored" for i in d["items"]]
    await drain_all(make_ctx())
    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()
    text = (await api.get("/metrics")).text
    samples: dict[tuple[str, Any], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "rollout_broker_reward_latency_seconds":
            assert family.type == "histogram"
            for s in family.samples:
                assert s.labels.pop("run") == RUN
                samples[(s.name, s.labels.get("le"))] = s.value
    name = "rollout_broker_reward_latency_seconds"
    bounds = [str(b / 1000) for b in REWARD_LATENCY_BOUNDS_MS]
    assert {le: samples[(f"{name}_bucket", le)] for le in [*bounds, "+Inf"]} == {
        le: sum(1 for ms in waits if le == "+Inf" or ms / 1000 <= float(le))
        for le in [*bounds, "+Inf"]
    }
    assert samples[(f"{name}_count", None)] == len(waits) == acc["rewards"]["scored"] == 2
    assert samples[(f"{name}_sum", None)] == pytest.approx(acc["wait"]["reward_s"])


def test_a_score_beyond_the_last_bound_is_in_the_inf_bucket_only() -> None:
    """The ledger keeps no row for scores beyond the last bound: ``+Inf`` is every score."""
    buckets, total = _reward_latency_buckets({100: 1, 60_000: 2}, 4, 12.5)
    cumulative = dict(buckets)
    assert cumulative["0.1"] == 1 and cumulative["30.0"] == 1 and cumulative["60.0"] == 3
    assert cumulative[str(REWARD_LATENCY_BOUNDS_MS[-1] / 1000)] == 3
    assert cumulative["+Inf"] == 4 and total == 12.5
    assert list(cumulative)[-1] == "+Inf"
