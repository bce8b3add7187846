"""Difficulty pools over the API and the drain: the accounting's queued passes per pool equal the
broker's pool indexes in Redis, before and after a patch of the thresholds, skipped passes are
counted, and GET .../prompts?pool= lists the passes of each pool with their prompt's mean."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.api.support import patch
from tests.api.test_difficulty import answer, pools
from tests.api.test_prompts import register, work
from tests.helpers import make_run
from workers.drain import DrainContext, drain_once

# The ledger's reads are the subject; the pools' scripts have their own tests on both backends.
pytestmark = pytest.mark.one_node

RUN = "pools-e2e"


@pytest.fixture
def drain(redis: Redis, prefix: str, sessionmaker: Any) -> DrainContext:
    return DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain")


async def _prompts(api: httpx.AsyncClient, **params: str) -> list[dict[str, Any]]:
    resp = await api.get(f"/v1/runs/{RUN}/prompts", params={"limit": 1000, **params})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["next_cursor"] is None
    listed: list[dict[str, Any]] = body["prompts"]
    return listed


async def _agree(api: httpx.AsyncClient, redis: Redis, prefix: str) -> dict[str, Any]:
    """The accounting's prompts, once checked against the pool indexes and the listing."""
    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()
    assert acc["pending_events"] == 0
    prompts: dict[str, Any] = acc["prompts"]
    live = await pools(redis, prefix, RUN)
    assert prompts["pools"] == {name: len(passes) for name, passes in live.items()}
    assert sum(prompts["pools"].values()) == prompts["queued"]
    for name, passes in live.items():
        listed = await _prompts(api, pool=name, state="queued")
        assert {f"{p['prompt_id']}#{p['pass']}" for p in listed} == passes, name
    return prompts


async def test_the_ledgers_pools_are_the_brokers(
    api: httpx.AsyncClient, redis: Redis, prefix: str, drain: DrainContext
) -> None:
    weights = {"easy": 0.0, "normal": 1.0, "hard": 1.0}
    difficulty = {"easy_above": 0.8, "hard_below": 0.2, "weights": weights}
    await make_run(api, RUN, group_size=2, difficulty=difficulty)
    await register(api, RUN, "p1", "p2", "p3", "p4", epochs=3)
    await answer(api, RUN, {"p1": [1.0, 1.0], "p2": [0.0, 0.0], "p3": [0.0, 1.0]})
    await drain_once(drain)
    prompts = await _agree(api, redis, prefix)
    assert prompts["pools"] == {"easy": 2, "normal": 5, "hard": 2}
    assert prompts["skipped"] == 0
    means = {p["prompt_id"]: p["mean"] for p in await _prompts(api)}
    assert means == {"p1": 1.0, "p2": 0.0, "p3": 0.5, "p4": None}

    # A work request skips the easy pool's passes (weight 0) before it draws.
    assert await work(api, RUN, 1) is not None
    await drain_once(drain)
    prompts = await _agree(api, redis, prefix)
    assert prompts["skipped"] == 2 and prompts["pools"]["easy"] == 0
    assert prompts["registered"] == sum(
        prompts[k] for k in ("queued", "in_flight", "done", "failed")
    )
    skipped = await _prompts(api, state="skipped")
    assert [(p["prompt_id"], p["pass"]) for p in skipped] == [("p1", 2), ("p1", 3)]
    assert await _prompts(api, state="skipped", pool="easy") == skipped

    # New thresholds sort the queue again in Redis, and the ledger's pools follow.
    before = prompts["pools"]
    await patch(api, RUN, difficulty={**difficulty, "easy_above": 0.4, "hard_below": -1.0})
    await drain_once(drain)
    prompts = await _agree(api, redis, prefix)
    assert prompts["pools"] != before and prompts["pools"]["hard"] == 0
