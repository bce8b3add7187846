"""Closing a run ends its prompt passes that would otherwise wait for ever (design.md, "Closing a
run"): queued passes are cancelled at once, in bounded steps, and a pass on its way back to the
queue afterwards (its work lease returned or expired, its buffered group retired `run_closed`)
is cancelled instead of queued, its partials dropped. The ledger counts them, so a closed run's
passes add up with none left `queued`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app import keys
from app.broker.store import RedisStore
from tests.api.support import assert_error, events
from tests.api.test_prompts import expire_now, give_back, handed, pass_events, register, work
from tests.helpers import make_run, post, rollout
from workers.drain import DrainContext, drain_once


def partial(p: dict[str, Any], k: int, tokens: int = 2) -> dict[str, Any]:
    """A response to a handed-out prompt, interrupted after `tokens` tokens (no reward)."""
    r = rollout(f"{p['group_id']}/{k}", 0, tokens=tokens, group=p["group_id"], reward=None)
    del r["finish_reason"]
    return r


async def pass_states(redis: Redis, prefix: str, run: str, *pks: str) -> dict[str, str]:
    out = {}
    for pk in pks:
        st = await redis.hget(keys.member_key(prefix, run, keys.PASS, pk), "st")
        out[pk] = st.decode() if st is not None else "?"
    return out


async def test_closing_cancels_the_queued_passes_and_those_that_come_back(
    api: httpx.AsyncClient, redis: Redis, prefix: str
) -> None:
    await make_run(api, "r", group_size=1)
    await register(api, "r", "a", "b", "c", "d", "e")
    held = await work(api, "r", 3)
    assert held is not None and handed(held) == [("a", 1, 1), ("b", 1, 1), ("c", 1, 1)]
    a, b, _ = held["prompts"]
    # a is buffered, b goes back with a partial response, c stays in the work lease.
    await post(api, "r", rollout("a/0", 0, group=a["group_id"]))
    resp = await api.post(
        f"/v1/runs/r/work/{held['lease_id']}/return",
        json={"prompt_ids": ["b"], "partials": [partial(b, 0)]},
    )
    assert resp.json() == {"returned": 1}
    before = len(await pass_events(redis, prefix, "r"))

    assert (await api.post("/v1/runs/r/close")).status_code == 200
    closed = (await pass_events(redis, prefix, "r"))[before:]
    # b (given back: queued at its next attempt), d and e were queued; a's group retired
    # run_closed, unused, so its pass would have gone back to the queue at its next attempt: all
    # four are cancelled, at the attempt they were at (no new attempt starts for a).
    assert sorted((cause, item[0], item[2], item[3]) for cause, item in closed) == [
        ("closed", "b", 2, "cancelled"),
        ("closed", "d", 1, "cancelled"),
        ("closed", "e", 1, "cancelled"),
        ("retired", "a", 1, "cancelled"),
    ]
    assert await redis.zcard(keys.run_key(prefix, "r", keys.PROMPT_QUEUE)) == 0
    dropped = [d for e, d in await events(redis, prefix, "r") if e == "partials"][-1]
    assert (dropped["change"], dropped["reason"]) == ("dropped", "cancelled")
    assert [item[0] for item in dropped["items"]] == [f"{b['group_id']}/0"]

    # c comes back when its lease ends: cancelled, not queued.
    await expire_now(redis, prefix, "r", held["lease_id"])
    store = RedisStore(redis, prefix)
    await store.sweep("r")
    last = (await pass_events(redis, prefix, "r"))[-1]
    assert (last[0], last[1][0], last[1][3]) == ("expired", "c", "cancelled")
    states = await pass_states(redis, prefix, "r", "a#1", "b#1", "c#1", "d#1", "e#1")
    assert set(states.values()) == {"c"}, states
    resp = await api.post("/v1/runs/r/work", json={"max_prompts": 5})
    assert_error(resp, 409, "RunClosed")


async def test_a_closed_run_cancels_a_big_queue_in_bounded_steps(
    api: httpx.AsyncClient, redis: Redis, prefix: str
) -> None:
    await make_run(api, "r", group_size=1)
    await register(api, "r", *(f"p{i}" for i in range(7)), epochs=2)
    store = RedisStore(redis, prefix)
    queue = keys.run_key(prefix, "r", keys.PROMPT_QUEUE)
    (more,) = await store._call("close_run", "r", 5, b"")
    assert int(more) == 1 and await redis.zcard(queue) == 14 - 5
    # Not settled while passes are queued: neither parked nor deleted.
    resp = await api.delete("/v1/runs/r")
    assert "prompt passes are still queued" in assert_error(resp, 409, "RunBusy")
    sweeps = 0
    while (await store.sweep("r", limit=5)).more:
        sweeps += 1
    assert sweeps == 1 and await redis.zcard(queue) == 0
    cancelled = [item for cause, item in await pass_events(redis, prefix, "r") if cause == "closed"]
    assert sorted((item[0], item[1]) for item in cancelled) == sorted(
        (f"p{i}", n) for i in range(7) for n in (1, 2)
    )
    # Nothing is left for the run to wait for but the accounting's events.
    resp = await api.delete("/v1/runs/r")
    assert resp.status_code == 409 and "accounting" in resp.json()["detail"], resp.text


@pytest.mark.one_node  # the ledger's fold is the subject: the scripts above run on both backends
async def test_the_ledger_counts_cancelled_passes_and_they_add_up(
    api: httpx.AsyncClient, redis: Redis, prefix: str, sessionmaker: Any
) -> None:
    drain = DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain")
    await make_run(api, "r", group_size=1)
    await register(api, "r", "a", "b", "c", epochs=2)
    held = await work(api, "r", 1)
    assert held is not None
    await give_back(api, "r", held["lease_id"])  # a comes back once: a retry
    assert (await api.post("/v1/runs/r/close")).status_code == 200
    await drain_once(drain)
    acc = (await api.get("/v1/runs/r/accounting")).json()
    assert acc["pending_events"] == 0
    prompts = acc["prompts"]
    assert (prompts["cancelled"], prompts["queued"], prompts["in_flight"]) == (6, 0, 0)
    assert prompts["done"] == 6 and prompts["skipped"] == 0
    assert prompts["registered"] == sum(
        prompts[k] for k in ("queued", "in_flight", "done", "failed")
    )
    resp = await api.get("/v1/runs/r/prompts", params={"state": "cancelled", "limit": 100})
    listed = resp.json()["prompts"]
    assert sorted((p["prompt_id"], p["pass"]) for p in listed) == [
        (pid, n) for pid in ("a", "b", "c") for n in (1, 2)
    ]
    assert (await api.get("/v1/runs/r/prompts", params={"state": "queued"})).json()["prompts"] == []
    # The run has settled: it can be deleted.
    assert (await api.delete("/v1/runs/r")).status_code == 204
