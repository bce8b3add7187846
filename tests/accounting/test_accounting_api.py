"""The accounting endpoints over ASGI, on a minimal app that includes only their router."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from accounting_helpers import RunSim, drain_all, register_run, xadd_events
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import queries
from app.accounting.stream import EventStream, LiveSnapshot
from app.keys import CONSUMER_GROUP, events_key
from workers.drain import DrainContext


def _cursor(value: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode()


ENDPOINTS = ("accounting", "accounting/versions", "batches", "prompts", "accounting/dead-letters")


async def test_unknown_run_is_404(accounting_api: httpx.AsyncClient) -> None:
    for path in ENDPOINTS:
        resp = await accounting_api.get(f"/v1/runs/no-such-run/{path}")
        assert resp.status_code == 404, path
        body = resp.json()
        assert body["error"] == "RunNotFound"
        assert "no-such-run" in body["detail"]


async def test_run_known_only_to_redis_reads_as_zeros(
    accounting_api: httpx.AsyncClient, redis: Redis, prefix: str, run_id: str
) -> None:
    await register_run(redis, prefix, run_id)
    sim = RunSim(run_id)
    sim.create()
    sim.ingest(2)
    await xadd_events(redis, prefix, run_id, sim.events)

    resp = await accounting_api.get(f"/v1/runs/{run_id}/accounting")
    assert resp.status_code == 200
    body = resp.json()
    assert body == {
        "rollouts_received": 0,
        "groups_received": 0,
        "duplicates": 0,
        "rejected": {},
        "tokens_generated": 0,
        "tokens_masked": 0,
        "tokens_masked_stale": 0,
        "buffered": 0,
        "leased": 0,
        "samples_consumed": 0,
        "samples_rewound": 0,
        "tokens_consumed": 0,
        "reuse_factor": 0.0,
        "retired": {},
        "wasted_tokens": 0,
        "batches": {"leased": 0, "acked": 0, "nacked": 0, "expired": 0},
        "lag": {"mean": None, "max": None, "histogram": {}, "token_mean": None},
        "kl": {"mean": None, "max": None},
        "is_ratio": {"mean": None, "clip_fraction": None},
        "kl_coef": None,
        "prompts": {
            "registered": 0,
            "queued": 0,
            "in_flight": 0,
            "done": 0,
            "failed": 0,
            "retried": 0,
            "skipped": 0,
            "cancelled": 0,
            "pools": None,
        },
        "partials": {
            "returned": 0,
            "resumed": 0,
            "dropped": 0,
            "tokens_resumed": 0,
            "tokens_dropped": 0,
        },
        "rewards": {"awaiting": 0, "leased": 0, "scored": 0, "timed_out": 0},
        "wait": {"generator_s": 0.0, "trainer_s": 0.0, "reward_s": 0.0},
        "bias": {
            "length": {
                "generated_mean": None,
                "trained_mean": None,
                "ks": None,
                "histogram": {"generated": {}, "trained": {}},
            },
            "reward": {"generated_mean": None, "trained_mean": None},
        },
        "as_of": None,
        # No consumer group yet: every entry of the stream is pending.
        "pending_events": len(sim.events),
        "dead_letters": 0,
        "live": None,  # the simulated run has no live counts in Redis
        "consumers": {},  # none: an empty map
    }
    versions = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/versions")).json()
    assert versions == {"versions": [], "as_of": None, "pending_events": len(sim.events)}
    assert (await accounting_api.get(f"/v1/runs/{run_id}/batches")).json() == {
        "batches": [],
        "next_cursor": None,
    }
    assert (await accounting_api.get(f"/v1/runs/{run_id}/prompts")).json() == {
        "prompts": [],
        "next_cursor": None,
    }
    dead = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/dead-letters")).json()
    assert dead == {"count": 0, "dead_letters": [], "next_cursor": None}


async def test_endpoints_after_drain(
    accounting_api: httpx.AsyncClient,
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
) -> None:
    sim = RunSim(run_id, seed=11, group_size=2)
    sim.workload(25)
    await register_run(redis, prefix, run_id)
    await xadd_events(redis, prefix, run_id, sim.events)
    ctx = make_ctx()
    await drain_all(ctx)

    body = (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert body["rollouts_received"] == len(sim.rollouts)
    assert datetime.fromisoformat(body["as_of"]) == datetime.fromtimestamp(sim.t / 1000, tz=UTC)
    assert body["pending_events"] == 0
    assert list(body) == [
        "rollouts_received", "groups_received", "duplicates", "rejected", "tokens_generated",
        "tokens_masked", "tokens_masked_stale", "buffered", "leased", "samples_consumed",
        "samples_rewound", "tokens_consumed", "reuse_factor", "retired",
        "wasted_tokens", "batches", "lag", "kl", "is_ratio", "kl_coef", "prompts", "partials",
        "rewards",
        "wait", "bias", "as_of", "pending_events", "dead_letters", "live", "consumers",
    ]  # fmt: skip

    # pending_events: delivered-but-unacknowledged plus never-delivered entries.
    key = events_key(prefix, run_id)
    more = RunSim(run_id, seed=12)
    more.ingest(1)
    more.ingest(1)
    more.ingest(1)
    await xadd_events(redis, prefix, run_id, more.events)
    await redis.xreadgroup(CONSUMER_GROUP, "slow", {key: ">"}, count=2)
    body = (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert body["pending_events"] == len(more.events)
    # The count Redis 6.2 falls back to agrees with Redis 7's group lag.
    group = (await redis.xinfo_groups(key))[0]
    counted = await ctx.drainer.stream.undelivered(run_id, group["last-delivered-id"])
    assert counted == len(more.events) - 2
    if group.get("lag") is not None:
        assert group["lag"] == counted

    # The batch ledger, page by page.
    seen = []
    cursor = None
    while True:
        params: dict[str, str | int] = {"limit": 3}
        if cursor is not None:
            params["cursor"] = cursor
        resp = await accounting_api.get(f"/v1/runs/{run_id}/batches", params=params)
        assert resp.status_code == 200
        page = resp.json()
        assert len(page["batches"]) <= 3
        seen.extend(page["batches"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert [b["batch_id"] for b in seen] == list(sim.batches)
    acked = next(b for b in seen if b["outcome"] == "acked")
    assert acked["acked_at"] is not None and acked["leased_at"] is not None
    assert acked["trainer_id"] == "trainer-0"
    assert set(acked) >= {
        "batch_id", "trainer_id", "policy_version", "leased_at", "expires_at", "acked_at",
        "nacked_at", "expired_at", "rewound_at", "outcome", "size", "tokens", "lag_mean", "lag_max",
        "kl_mean", "kl_max", "is_ratio_mean", "clip_fraction", "ess_fraction", "step",
    }  # fmt: skip
    expired = next(b for b in seen if b["outcome"] == "expired")
    assert expired["expired_at"] is not None and expired["acked_at"] is None

    for cursor in ("%%%", _cursor([1, 2**64, "b"]), _cursor([1, 2, "b\x00"]), _cursor([1, 2])):
        bad = await accounting_api.get(f"/v1/runs/{run_id}/batches", params={"cursor": cursor})
        assert bad.status_code == 400 and bad.json()["error"] == "BadRequest", cursor
    assert (
        await accounting_api.get(f"/v1/runs/{run_id}/batches", params={"limit": 0})
    ).status_code == 422
    bad = await accounting_api.get(
        f"/v1/runs/{run_id}/accounting/dead-letters", params={"cursor": "x"}
    )
    assert bad.status_code == 400

    versions = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/versions")).json()
    assert [v["policy_version"] for v in versions["versions"]] == sorted(sim.expected_versions())
    assert versions["as_of"] == body["as_of"]


async def test_nothing_pending_means_the_totals_are_complete(
    sessionmaker: async_sessionmaker[AsyncSession],
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
) -> None:
    """A reader that sees ``pending_events == 0`` takes the totals as final (the client's
    ``wait_for_accounting`` does), so they must include every event drained by then, even when
    a drain pass lands in the middle of the read."""
    sim = RunSim(run_id, seed=5)
    sim.workload(10)
    await register_run(redis, prefix, run_id)
    await xadd_events(redis, prefix, run_id, sim.events)
    ctx = make_ctx()

    class DrainedMeanwhile(EventStream):
        async def live_snapshot(self, run_id: str) -> LiveSnapshot:
            await drain_all(ctx)  # the worker finishes a pass while the request is reading
            return await super().live_snapshot(run_id)

    stream = DrainedMeanwhile(redis, prefix)
    async with sessionmaker() as session:
        totals = await queries.run_accounting(session, stream, run_id)
    assert totals.pending_events == 0
    assert totals.rollouts_received == len(sim.rollouts)

    before = len(sim.events)
    sim.ingest(3)
    await xadd_events(redis, prefix, run_id, sim.events[before:])
    async with sessionmaker() as session:
        versions = await queries.version_accounting(session, stream, run_id)
    assert versions.pending_events == 0
    assert sum(v.rollouts_received for v in versions.versions) == len(sim.rollouts)
