"""A rollout's generator_id under a work lease (SPEC "Rollouts": generator_id defaults to the work
lease's): what a trainer's lease hands back for rollouts posted with and without one."""

from __future__ import annotations

from typing import Any

import httpx

from tests.api.support import post_msgpack
from tests.helpers import lease, make_run, post, rollout


async def work(api: httpx.AsyncClient, run: str, k: int, **body: Any) -> list[dict[str, Any]]:
    """The prompts of a new work lease."""
    resp = await api.post(f"/v1/runs/{run}/work", json={"max_prompts": k, **body})
    assert resp.status_code == 200, resp.text
    prompts: list[dict[str, Any]] = resp.json()["prompts"]
    return prompts


async def generators(api: httpx.AsyncClient, run: str, n: int) -> dict[str, str | None]:
    """The generator_id of each rollout of a trainer's lease of ``n``, by rollout_id."""
    resp = await lease(api, run, n)
    assert resp.status_code == 200, resp.text
    return {r["rollout_id"]: r["generator_id"] for r in resp.json()["rollouts"]}


async def setup(api: httpx.AsyncClient, run: str, prompts: int) -> None:
    await make_run(api, run, group_size=2)
    resp = await api.post(
        f"/v1/runs/{run}/prompts",
        json={"prompts": [{"prompt_id": f"p{i}"} for i in range(prompts)]},
    )
    assert resp.status_code == 202, resp.text


async def test_rollouts_without_a_generator_id_take_their_work_leases(api):
    await setup(api, "r", 2)
    a, b = await work(api, "r", 2, generator_id="gen-a")
    ga, gb = a["group_id"], b["group_id"]
    own = {**rollout(f"{gb}/1", group=gb, reward=0.0), "generator_id": "gen-b"}
    resp = await post(api, "r", rollout(f"{ga}/0", group=ga), own)
    assert resp.status_code == 202 and resp.json()["accepted"] == 2, resp.text
    # A msgpack body is packed on its own path: the default holds there too.
    resp = await post_msgpack(
        api, "r", [rollout(f"{ga}/1", group=ga, reward=0.0), rollout(f"{gb}/0", group=gb)]
    )
    assert resp.status_code == 202 and resp.json()["accepted"] == 2, resp.text
    assert await generators(api, "r", 4) == {
        f"{ga}/0": "gen-a",
        f"{ga}/1": "gen-a",
        f"{gb}/0": "gen-a",
        f"{gb}/1": "gen-b",  # its own
    }


async def test_a_work_lease_without_a_generator_id_leaves_its_rollouts_without_one(api):
    await setup(api, "r", 1)
    (p,) = await work(api, "r", 1)
    g = p["group_id"]
    resp = await post(api, "r", rollout(f"{g}/0", group=g), rollout(f"{g}/1", group=g, reward=0))
    assert resp.status_code == 202 and resp.json()["accepted"] == 2, resp.text
    assert await generators(api, "r", 2) == {f"{g}/0": None, f"{g}/1": None}


async def test_rollouts_not_under_a_work_lease_have_no_generator_id(api):
    await setup(api, "r", 1)
    (p,) = await work(api, "r", 1, generator_id="gen-a")
    g = p["group_id"]
    # A group of its own, and one whose id has an attempt's form but names no registered prompt.
    resp = await post(
        api,
        "r",
        rollout("own/0", group="own"),
        rollout("own/1", group="own", reward=0.0),
        rollout("x/0", group="nope#1.1"),
        rollout("x/1", group="nope#1.1", reward=0.0),
    )
    assert resp.status_code == 202 and resp.json()["accepted"] == 4, resp.text
    assert await generators(api, "r", 4) == {
        "own/0": None,
        "own/1": None,
        "x/0": None,
        "x/1": None,
    }
    resp = await post(api, "r", rollout(f"{g}/0", group=g), rollout(f"{g}/1", group=g, reward=0))
    assert resp.json()["accepted"] == 2, resp.text
    assert await generators(api, "r", 2) == {f"{g}/0": "gen-a", f"{g}/1": "gen-a"}
