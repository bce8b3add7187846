"""Work leases under concurrency: generators on two API processes never hold one prompt attempt
at once, and a generator's long poll is woken by what frees work (prompts, budget), also when
that happens through another process."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import httpx
from redis.asyncio import Redis

from app import keys
from tests.api.support import events
from tests.helpers import answered_before, make_run, post, rollout, until_long_polling


async def until_generator_waits(redis: Redis, prefix: str, run: str) -> None:
    await until_long_polling(redis, prefix, run, keys.WORK_WAITING)


def work_poll(client: httpx.AsyncClient, run: str, wait_s: float) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(
        client.post(f"/v1/runs/{run}/work", json={"max_prompts": 1, "wait_s": wait_s})
    )


async def test_a_waiting_generator_is_woken_by_new_prompts(api, redis, prefix):
    await make_run(api, "r")
    await make_run(api, "idle")
    waiting = work_poll(api, "r", 20)
    await until_generator_waits(redis, prefix, "r")
    idle = work_poll(api, "idle", 4)
    await api.post("/v1/runs/r/prompts", json={"prompts": [{"prompt_id": "a"}]})
    resp = await answered_before(waiting, idle)
    assert resp.status_code == 200
    assert resp.json()["prompts"][0]["prompt_id"] == "a"


async def test_a_generator_waiting_for_budget_is_woken_by_the_next_version(api, redis, prefix):
    await make_run(api, "r", step_groups=1, max_staleness=0)
    await make_run(api, "idle")
    await api.post("/v1/runs/r/prompts", json={"prompts": [{"prompt_id": "a"}, {"prompt_id": "b"}]})
    first = await api.post("/v1/runs/r/work", json={"max_prompts": 5})
    assert [p["prompt_id"] for p in first.json()["prompts"]] == ["a"]
    waiting = work_poll(api, "r", 20)
    await until_generator_waits(redis, prefix, "r")
    idle = work_poll(api, "idle", 4)
    assert (await api.post("/v1/runs/r/policy", json={"version": 1})).status_code == 200
    resp = await answered_before(waiting, idle)
    assert resp.status_code == 200 and resp.json()["prompts"][0]["prompt_id"] == "b"


async def test_a_waiting_generator_is_woken_by_a_prompt_a_stale_rollout_sent_back(
    api, redis, prefix
):
    await make_run(api, "r", max_staleness=0)
    await make_run(api, "idle")
    await api.post("/v1/runs/r/prompts", json={"prompts": [{"prompt_id": "a"}]})
    first = (await api.post("/v1/runs/r/work", json={"max_prompts": 1})).json()
    assert (await api.post("/v1/runs/r/policy", json={"version": 1})).status_code == 200
    waiting = work_poll(api, "r", 20)
    await until_generator_waits(redis, prefix, "r")
    idle = work_poll(api, "idle", 4)
    # The request also admits a rollout of its own: the budget's count is unchanged, yet a
    # prompt came back.
    out = await post(
        api, "r", rollout("own", 1), rollout("a-0", 0, group=first["prompts"][0]["group_id"])
    )
    assert out.json()["rejected"] == [{"rollout_id": "a-0", "reason": "stale"}]
    resp = await answered_before(waiting, idle)
    assert resp.status_code == 200 and resp.json()["prompts"][0]["group_id"] == "a#1.2"


async def test_a_generator_waiting_on_one_process_is_woken_through_another(
    api_servers, redis, prefix
):
    a, b = (httpx.AsyncClient(base_url=url, timeout=30) for url in api_servers)
    async with a, b:
        await make_run(a, "r", step_groups=1, max_staleness=0)
        await make_run(a, "idle")
        await b.post(
            "/v1/runs/r/prompts", json={"prompts": [{"prompt_id": "x"}, {"prompt_id": "y"}]}
        )
        got = (await a.post("/v1/runs/r/work", json={"max_prompts": 1})).json()
        waiting = work_poll(a, "r", 20)
        await until_generator_waits(redis, prefix, "r")
        idle = work_poll(a, "idle", 4)
        # Returning the prompt through the other process frees the budget and the prompt.
        resp = await b.post(f"/v1/runs/r/work/{got['lease_id']}/return", json={})
        assert resp.json() == {"returned": 1}
        resp = await answered_before(waiting, idle)
        assert resp.status_code == 200
        assert [(p["prompt_id"], p["attempt"]) for p in resp.json()["prompts"]] == [("x", 2)]


async def test_eight_generators_on_two_processes_never_hold_one_attempt_twice(
    api_servers, redis, prefix
):
    clients = [httpx.AsyncClient(base_url=url, timeout=30) for url in api_servers]
    n_prompts = 120
    try:
        await make_run(clients[0], "r", group_size=2)
        body = {"prompts": [{"prompt_id": f"p{i}"} for i in range(n_prompts)]}
        assert (await clients[1].post("/v1/runs/r/prompts", json=body)).status_code == 202
        handed: list[tuple[str, int, int]] = []
        holding: dict[tuple[str, int], int] = {}  # (prompt, pass) -> generator holding it
        posted: Counter[str] = Counter()

        async def generator(g: int) -> None:
            rng = random.Random(g)
            client = clients[g % 2]
            while True:
                resp = await client.post(
                    "/v1/runs/r/work",
                    json={"max_prompts": rng.randint(1, 4), "generator_id": f"g{g}"},
                )
                if resp.status_code == 204:
                    return
                lease: dict[str, Any] = resp.json()
                for p in lease["prompts"]:
                    key = (p["prompt_id"], p["pass"])
                    # No other generator holds this prompt pass while this one does.
                    assert key not in holding, (key, holding[key], g)
                    holding[key] = g
                    handed.append((p["prompt_id"], p["pass"], p["attempt"]))
                give_back = [p for p in lease["prompts"] if rng.random() < 0.25]
                for p in lease["prompts"]:
                    if p in give_back:
                        continue
                    gid = p["group_id"]
                    out = await post(
                        clients[rng.randrange(2)],
                        "r",
                        *[rollout(f"{gid}/{i}", group=gid, reward=float(i)) for i in range(2)],
                    )
                    assert out.json()["accepted"] == 2, out.text
                    posted[p["prompt_id"]] += 1
                    del holding[(p["prompt_id"], p["pass"])]
                    await asyncio.sleep(0)
                if give_back:
                    for p in give_back:  # no longer held once the return is answered
                        del holding[(p["prompt_id"], p["pass"])]
                    resp = await clients[rng.randrange(2)].post(
                        f"/v1/runs/r/work/{lease['lease_id']}/return",
                        json={"prompt_ids": [p["prompt_id"] for p in give_back]},
                    )
                    assert resp.json() == {"returned": len(give_back)}

        await asyncio.gather(*(generator(g) for g in range(8)))
        # Each attempt was handed out once, and every prompt's group came in exactly once.
        assert len(handed) == len(set(handed))
        assert sorted(posted) == sorted(f"p{i}" for i in range(n_prompts))
        assert set(posted.values()) == {1}
        assert max(a for _, _, a in handed) > 1  # returns happened, and came back
        leased = [d for e, d in await events(redis, prefix, "r") if e == "work_leased"]
        from_events = [tuple(item) for d in leased for item in d["items"]]
        assert sorted(from_events) == sorted(handed)
    finally:
        for c in clients:
            await c.aclose()
