"""Policy versions: forward only, same is a no-op, advancing evicts what became stale."""

from __future__ import annotations

import asyncio

import pytest

from tests.api.support import assert_error, ids, nack, retired, retired_items, set_policy
from tests.helpers import lease, make_run, post, rollout


async def test_policy_moves_forward_and_same_version_is_a_noop(api):
    await make_run(api, "r1")
    assert await set_policy(api, "r1", 1) == {"policy_version": 1, "evicted": 0}
    assert await set_policy(api, "r1", 5) == {"policy_version": 5, "evicted": 0}
    assert (await api.get("/v1/runs/r1")).json()["policy_version"] == 5
    assert await set_policy(api, "r1", 5) == {"policy_version": 5, "evicted": 0}
    assert (await api.get("/v1/runs/r1")).json()["policy_version"] == 5


async def test_lower_version_is_409_version_conflict(api):
    await make_run(api, "r1")
    await set_policy(api, "r1", 4)
    resp = await api.post("/v1/runs/r1/policy", json={"version": 3})
    assert_error(resp, 409, "VersionConflict")
    assert (await api.get("/v1/runs/r1")).json()["policy_version"] == 4


@pytest.mark.parametrize("body", [{}, {"version": -1}, {"version": "x"}, {"version": 1, "x": 1}])
async def test_invalid_policy_body_is_422(api, body):
    await make_run(api, "r1")
    assert_error(await api.post("/v1/runs/r1/policy", json=body), 422, "ValidationFailed")
    assert (await api.get("/v1/runs/r1")).json()["policy_version"] == 0


async def test_advancing_evicts_exactly_the_rollouts_beyond_max_staleness(api, redis, prefix):
    await make_run(api, "r1", max_staleness=1)
    assert (await post(api, "r1", rollout("a0"), rollout("b0"), rollout("c0"))).json()[
        "accepted"
    ] == 3
    # lag 1 is still allowed
    assert await set_policy(api, "r1", 1) == {"policy_version": 1, "evicted": 0}
    assert (await post(api, "r1", rollout("d1", 1), rollout("e1", 1))).json()["accepted"] == 2
    assert await set_policy(api, "r1", 2) == {"policy_version": 2, "evicted": 3}
    items = await retired_items(redis, prefix, "r1")
    assert sorted(items) == ["stale"]
    assert sorted(items["stale"]) == [["a0", 0, 4, 0], ["b0", 0, 4, 0], ["c0", 0, 4, 0]]

    resp = await lease(api, "r1", 10, partial=True)
    assert resp.status_code == 200, resp.text
    batch = resp.json()
    assert sorted(ids(batch)) == ["d1", "e1"]
    assert {r["lag"] for r in batch["rollouts"]} == {1}
    assert batch["policy_version"] == 2

    # A jump evicts everything left behind; the stale ones were already gone.
    await nack(api, "r1", batch["batch_id"])
    assert await set_policy(api, "r1", 10) == {"policy_version": 10, "evicted": 2}
    assert (await retired(redis, prefix, "r1")) == {"stale": ["a0", "b0", "c0", "d1", "e1"]}
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204


async def test_max_staleness_zero_evicts_on_every_step(api, redis, prefix):
    await make_run(api, "r1", max_staleness=0)
    await post(api, "r1", rollout("a"))
    assert await set_policy(api, "r1", 1) == {"policy_version": 1, "evicted": 1}
    assert (await lease(api, "r1", 1)).status_code == 204
    assert (await retired(redis, prefix, "r1")) == {"stale": ["a"]}


async def test_a_leased_rollout_that_became_stale_is_never_leased_again(api, redis, prefix):
    await make_run(api, "r1", max_staleness=1, max_reuse=5)
    await post(api, "r1", rollout("a"))
    batch = (await lease(api, "r1", 1)).json()
    # Leased rollouts are not buffered: nothing to evict now.
    assert await set_policy(api, "r1", 2) == {"policy_version": 2, "evicted": 0}
    resp = await nack(api, "r1", batch["batch_id"])
    assert resp.status_code == 200
    assert resp.json() == {"returned": 1}
    assert (await retired(redis, prefix, "r1")) == {"stale": ["a"]}
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204


async def test_eviction_covers_incomplete_groups(api, redis, prefix):
    await make_run(api, "r1", group_size=2, max_staleness=0)
    await post(api, "r1", rollout("g1-a", group="g1"), rollout("g2-a", group="g2"))
    await post(api, "r1", rollout("g2-b", group="g2"))
    assert await set_policy(api, "r1", 1) == {"policy_version": 1, "evicted": 3}
    assert (await retired(redis, prefix, "r1")) == {"stale": ["g1-a", "g2-a", "g2-b"]}


async def test_a_leased_rollout_that_became_stale_retires_on_ack(api, redis, prefix):
    await make_run(api, "r1", max_staleness=1, max_reuse=5)
    await post(api, "r1", rollout("a"), rollout("b"))
    batch = (await lease(api, "r1", 1)).json()
    assert ids(batch) == ["a"]
    assert await set_policy(api, "r1", 2) == {"policy_version": 2, "evicted": 1}  # b
    resp = await api.post(f"/v1/runs/r1/batches/{batch['batch_id']}/ack", json={})
    assert resp.status_code == 200
    assert resp.json()["consumed"] == 1
    assert resp.json()["retired"] == 1
    assert (await retired_items(redis, prefix, "r1")) == {"stale": [["b", 0, 4, 0], ["a", 0, 4, 1]]}


async def test_evicted_counts_only_what_the_new_version_made_stale(api, redis, prefix):
    """The same sweep also times out incomplete groups (and expires leases); those rollouts
    retire for their own reasons, not because the version moved, so they are not evicted."""
    await make_run(api, "r1", group_size=2, max_staleness=1, group_timeout_s=0.05)
    await post(api, "r1", rollout("lonely", group="g0"))  # never completes
    await asyncio.sleep(0.1)  # past its timeout; no worker sweeps in these tests
    assert await set_policy(api, "r1", 1) == {"policy_version": 1, "evicted": 0}
    assert await retired(redis, prefix, "r1") == {"incomplete_group": ["lonely"]}

    await post(api, "r1", rollout("a", 1, group="g1"), rollout("b", 1, group="g1"))
    await post(api, "r1", rollout("late", 1, group="g2"))
    await asyncio.sleep(0.1)
    assert await set_policy(api, "r1", 3) == {"policy_version": 3, "evicted": 2}
    assert await retired(redis, prefix, "r1") == {
        "incomplete_group": ["late", "lonely"],
        "stale": ["a", "b"],
    }
