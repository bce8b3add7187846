"""The accounting of rewards that arrive later, from the real broker's scripts through the real
drain: `rewards: {awaiting, leased, scored, timed_out}`, `wait.reward_s`, the retirements
`reward_timeout`, and the ledger equal to the live state at every step."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
from accounting_helpers import drain_all

from tests.helpers import make_run, post, rollout
from workers.drain import DrainContext

RUN = "rw"


def group(gid: str, *rewards: float | None) -> list[dict[str, Any]]:
    return [rollout(f"{gid}-{i}", group=gid, reward=r) for i, r in enumerate(rewards)]


async def reward_lease(api: httpx.AsyncClient, k: int, lease_id: str) -> list[str]:
    body = {"max_rollouts": k, "lease_id": lease_id}
    resp = await api.post(f"/v1/runs/{RUN}/rewards/lease", json=body)
    assert resp.status_code == 200, resp.text
    return [r["rollout_id"] for r in resp.json()["rollouts"]]


async def expire(api: httpx.AsyncClient, lease_id: str) -> None:
    """Wait out a reward lease; asking for it again once it ran out ends it (409)."""
    while True:
        body = {"max_rollouts": 1, "lease_id": lease_id}
        if (await api.post(f"/v1/runs/{RUN}/rewards/lease", json=body)).status_code == 409:
            return
        await asyncio.sleep(0.02)


async def test_rewards_are_accounted_and_the_ledger_equals_the_live_state(
    api: httpx.AsyncClient, make_ctx: Callable[..., DrainContext]
) -> None:
    await make_run(api, RUN, group_size=2, reward_timeout_s=0.05, max_reward_attempts=2)

    async def accounting() -> dict[str, Any]:
        await drain_all(make_ctx())
        acc: dict[str, Any] = (await api.get(f"/v1/runs/{RUN}/accounting")).json()
        assert acc["pending_events"] == acc["dead_letters"] == 0
        assert acc["live"]["rewards"] == {
            "awaiting": acc["rewards"]["awaiting"],
            "leased": acc["rewards"]["leased"],
        }
        assert acc["rollouts_received"] == (
            acc["buffered"] + acc["leased"] + sum(acc["retired"].values())
        )
        return acc

    await post(api, RUN, *group("g0", None, None), *group("g1", 1.0, None))
    acc = await accounting()
    assert acc["rewards"] == {"awaiting": 3, "leased": 0, "scored": 0, "timed_out": 0}
    assert acc["buffered"] == 4  # awaiting rollouts are buffered

    assert await reward_lease(api, 2, "lease-0001") == ["g0-0", "g0-1"]
    scored = await api.post(
        f"/v1/runs/{RUN}/rewards", json={"rewards": {"g0-0": 0.0}, "lease_id": "lease-0001"}
    )
    assert scored.json()["scored"] == 1
    acc = await accounting()
    assert acc["rewards"] == {"awaiting": 1, "leased": 1, "scored": 1, "timed_out": 0}

    await expire(api, "lease-0001")  # g0-1 comes back: one expiry
    assert await reward_lease(api, 2, "lease-0002") == ["g0-1", "g1-1"]
    acc = await accounting()
    assert acc["rewards"] == {"awaiting": 0, "leased": 2, "scored": 1, "timed_out": 1}
    body = {"rewards": {"g0-1": 1.0, "g1-1": 0.5}, "lease_id": "lease-0002"}
    assert (await api.post(f"/v1/runs/{RUN}/rewards", json=body)).json()["scored"] == 2
    acc = await accounting()
    assert acc["rewards"] == {"awaiting": 0, "leased": 0, "scored": 3, "timed_out": 1}
    assert acc["wait"]["reward_s"] > 0

    # A group whose reward leases all run out retires `reward_timeout`, each expiry counted.
    await post(api, RUN, *group("g2", None, None))
    for lid in ("lease-0003", "lease-0004"):
        assert await reward_lease(api, 2, lid) == ["g2-0", "g2-1"]
        await expire(api, lid)
    acc = await accounting()
    assert acc["rewards"] == {"awaiting": 0, "leased": 0, "scored": 3, "timed_out": 5}
    assert acc["retired"] == {"reward_timeout": 2}
    assert acc["buffered"] == 4
