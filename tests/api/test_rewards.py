"""Rewards that arrive later (SPEC "Rewards"): rollouts posted without a reward await it, reward
workers lease them and post scores, and no trainer gets a rollout before it is scored."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from app.keys import AWAITING, REWARD_WAITING, run_key
from tests.api.support import assert_error, events, retired, set_policy
from tests.helpers import answered_before, lease, make_run, post, rollout, until_long_polling


async def reward_lease(api: httpx.AsyncClient, run_id: str, k: int, **body: Any) -> httpx.Response:
    return await api.post(f"/v1/runs/{run_id}/rewards/lease", json={"max_rollouts": k, **body})


async def score(
    api: httpx.AsyncClient, run_id: str, rewards: dict[str, float], **body: Any
) -> httpx.Response:
    return await api.post(f"/v1/runs/{run_id}/rewards", json={"rewards": rewards, **body})


def rids(answer: httpx.Response) -> list[str]:
    return [r["rollout_id"] for r in answer.json()["rollouts"]]


async def test_a_rollout_without_reward_is_trained_only_once_scored(api):
    await make_run(api, "r1")
    resp = await post(api, "r1", rollout("a", reward=None), rollout("b"))
    assert resp.json()["accepted"] == 2
    got = await lease(api, "r1", 2, partial=True)
    assert [r["rollout_id"] for r in got.json()["rollouts"]] == ["b"]

    leased = await reward_lease(api, "r1", 4, worker_id="judge-1")
    assert leased.status_code == 200, leased.text
    body = leased.json()
    assert rids(leased) == ["a"]
    one = body["rollouts"][0]
    assert one["response_ids"] == [10, 11, 12, 13] and one["prompt_ids"] == [1, 2, 3]
    assert "reward" not in one
    assert (await reward_lease(api, "r1", 4)).status_code == 204  # nothing else awaits

    assert (await lease(api, "r1", 1)).status_code == 204  # still unscored
    done = await score(api, "r1", {"a": 0.25}, lease_id=body["lease_id"])
    assert done.json() == {"scored": 1, "duplicates": 0, "retired": []}
    got = await lease(api, "r1", 1)
    assert got.status_code == 200
    assert got.json()["rollouts"][0]["reward"] == 0.25


async def test_a_group_is_leased_whole_and_handed_out_at_its_last_score(api):
    await make_run(api, "r1", group_size=3)
    await post(api, "r1", rollout("a", group="g", reward=None), rollout("b", group="g"))
    # A group still filling is not leased for rewards.
    assert (await reward_lease(api, "r1", 8)).status_code == 204
    await post(api, "r1", rollout("c", group="g", reward=None))
    leased = await reward_lease(api, "r1", 1)  # the group is more than 1: taken whole
    assert sorted(rids(leased)) == ["a", "c"]
    lid = leased.json()["lease_id"]
    assert (await score(api, "r1", {"a": 1.0}, lease_id=lid)).json()["scored"] == 1
    assert (await lease(api, "r1", 3)).status_code == 204  # one member is still unscored
    assert (await score(api, "r1", {"c": 0.0}, lease_id=lid)).json()["scored"] == 1
    got = await lease(api, "r1", 3)
    assert {r["rollout_id"]: r["reward"] for r in got.json()["rollouts"]} == {
        "a": 1.0,
        "b": 1.0,
        "c": 0.0,
    }


async def test_scores_are_idempotent_and_a_different_value_is_refused(api, redis, prefix):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a", reward=None), rollout("b", reward=None), rollout("c"))
    assert (await score(api, "r1", {"a": 0.5})).json()["scored"] == 1  # without a lease
    again = await score(api, "r1", {"a": 0.5, "b": 2.0})
    assert again.json() == {"scored": 1, "duplicates": 1, "retired": []}
    # A different value for a scored rollout, or one posted with its reward: 409, nothing done.
    before = await events(redis, prefix, "r1")
    assert_error(await score(api, "r1", {"a": 0.75}), 409, "RewardConflict")
    assert_error(await score(api, "r1", {"c": 0.0}), 409, "RewardConflict")
    assert (await score(api, "r1", {"c": 1.0})).json()["duplicates"] == 1
    assert await events(redis, prefix, "r1") == before


@pytest.mark.parametrize(
    "body",
    [
        '{"rewards": {"nope": 1.0}}',
        '{"rewards": {"a": NaN}}',
        '{"rewards": {"a": Infinity}}',
        '{"rewards": {"a": 1e308}}',
        '{"rewards": {"a": -1.000001e12}}',
        '{"rewards": {"a": "1"}}',
        '{"rewards": {"a": true}}',
        '{"rewards": {"a": 1.0}, "extra": 1}',
        '{"rewards": [1.0]}',
    ],
    ids=["unknown", "nan", "inf", "huge", "beyond_bound", "text", "bool", "extra", "list"],
)
async def test_bad_rewards_change_nothing(api, redis, prefix, body):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a", reward=None))
    before = await redis.hgetall(run_key(prefix, "r1", AWAITING))
    resp = await api.post(
        "/v1/runs/r1/rewards", content=body, headers={"content-type": "application/json"}
    )
    assert_error(resp, 422, "ValidationFailed")
    assert await redis.hgetall(run_key(prefix, "r1", AWAITING)) == before
    assert (await lease(api, "r1", 1)).status_code == 204


async def test_rewards_up_to_the_bound_are_taken_and_the_bound_is_documented(api):
    """|reward| ≤ 1e12 (the ledger sums them in doubles): the bound itself is a reward, posted
    with the rollout or later; /openapi.json tells it for both."""
    await make_run(api, "r1")
    resp = await post(api, "r1", rollout("a", reward=-1e12), rollout("b", reward=None))
    assert resp.json()["accepted"] == 2
    assert (await score(api, "r1", {"b": 1e12})).json()["scored"] == 1
    got = await lease(api, "r1", 2)
    assert sorted(r["reward"] for r in got.json()["rollouts"]) == [-1e12, 1e12]
    schemas = (await api.get("/openapi.json")).json()["components"]["schemas"]
    bound = {"minimum": -1e12, "maximum": 1e12}
    rollout_reward = schemas["RolloutJSON"]["properties"]["reward"]["anyOf"][0]
    assert bound.items() <= rollout_reward.items()
    (score_reward,) = schemas["ScoreBody"]["properties"]["rewards"]["patternProperties"].values()
    assert bound.items() <= score_reward.items()


async def test_a_rollout_of_another_lease_is_refused(api):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a", reward=None), rollout("b", reward=None))
    one = (await reward_lease(api, "r1", 1)).json()
    two = (await reward_lease(api, "r1", 1)).json()
    assert [one["rollouts"][0]["rollout_id"], two["rollouts"][0]["rollout_id"]] == ["a", "b"]
    resp = await score(api, "r1", {"a": 1.0, "b": 1.0}, lease_id=one["lease_id"])
    assert_error(resp, 422, "ValidationFailed")
    assert (await score(api, "r1", {"a": 1.0}, lease_id=one["lease_id"])).json()["scored"] == 1
    resp = await score(api, "r1", {"a": 1.0}, lease_id="no-such-lease")
    assert_error(resp, 422, "ValidationFailed")


async def test_a_retried_lease_request_returns_the_same_lease(api):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a", reward=None), rollout("b", reward=None))
    first = await reward_lease(api, "r1", 1, lease_id="lease-0001")
    again = await reward_lease(api, "r1", 1, lease_id="lease-0001")
    assert first.json() == again.json()
    assert rids(await reward_lease(api, "r1", 5)) == ["b"]


async def test_given_back_rollouts_are_leased_again_at_once(api):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a", reward=None))
    lid = (await reward_lease(api, "r1", 1)).json()["lease_id"]
    resp = await api.post(f"/v1/runs/r1/rewards/lease/{lid}/return", json={})
    assert resp.json() == {"returned": 1}
    assert rids(await reward_lease(api, "r1", 1)) == ["a"]


async def test_stale_awaiting_rollouts_retire_and_a_late_score_is_told(api, redis, prefix):
    await make_run(api, "r1", max_staleness=0)
    await post(api, "r1", rollout("a", reward=None))
    await set_policy(api, "r1", 1)
    assert (await retired(redis, prefix, "r1")) == {"stale": ["a"]}
    assert (await reward_lease(api, "r1", 1)).status_code == 204  # no longer to be scored
    resp = await score(api, "r1", {"a": 1.0})
    assert resp.json() == {"scored": 0, "duplicates": 0, "retired": ["a"]}


async def _expire(api: httpx.AsyncClient, run_id: str, lease_id: str) -> None:
    """Wait out a reward lease (the run's reward_timeout_s is a few tens of ms): a request for
    it again finds it over, which sweeps it."""
    while True:
        resp = await reward_lease(api, run_id, 1, lease_id=lease_id)
        if resp.status_code == 409:
            return
        await asyncio.sleep(0.02)


async def test_an_expired_reward_lease_is_leased_again_then_retires(api, redis, prefix):
    await make_run(api, "r1", reward_timeout_s=0.05, max_reward_attempts=2)
    await post(api, "r1", rollout("a", reward=None))
    first = await reward_lease(api, "r1", 1, lease_id="lease-0001")
    assert rids(first) == ["a"]
    await _expire(api, "r1", "lease-0001")
    # A score under the expired lease is still taken while the rollout awaits it.
    second = await reward_lease(api, "r1", 1, lease_id="lease-0002")
    assert rids(second) == ["a"]
    await _expire(api, "r1", "lease-0002")
    # Expired twice, at max_reward_attempts: retired, and nothing is left to lease.
    assert (await reward_lease(api, "r1", 1)).status_code == 204
    assert (await retired(redis, prefix, "r1")) == {"reward_timeout": ["a"]}
    resp = await score(api, "r1", {"a": 1.0})
    assert resp.json() == {"scored": 0, "duplicates": 0, "retired": ["a"]}
    kinds = [e for e, _ in await events(redis, prefix, "r1")]
    assert kinds.count("reward_expired") == 2 and kinds.count("reward_leased") == 2


async def test_a_late_score_under_an_expired_lease_is_taken(api):
    await make_run(api, "r1", reward_timeout_s=0.05)
    await post(api, "r1", rollout("a", reward=None))
    await reward_lease(api, "r1", 1, lease_id="lease-0001")
    await _expire(api, "r1", "lease-0001")
    resp = await score(api, "r1", {"a": 0.5}, lease_id="lease-0001")
    assert resp.json()["scored"] == 1
    assert (await lease(api, "r1", 1)).json()["rollouts"][0]["reward"] == 0.5


async def test_a_group_timed_out_for_its_reward_sends_its_prompt_back(api, redis, prefix):
    await make_run(api, "r1", group_size=2, reward_timeout_s=0.05, max_reward_attempts=1)
    await api.post("/v1/runs/r1/prompts", json={"prompts": [{"prompt_id": "p"}]})
    work = (await api.post("/v1/runs/r1/work", json={"max_prompts": 1})).json()
    gid = work["prompts"][0]["group_id"]
    members = [dict(rollout(f"{gid}/{i}", group=gid, reward=None)) for i in range(2)]
    assert (await post(api, "r1", *members)).json()["accepted"] == 2
    await reward_lease(api, "r1", 2, lease_id="lease-0001")
    await _expire(api, "r1", "lease-0001")
    assert sorted((await retired(redis, prefix, "r1"))["reward_timeout"]) == sorted(
        m["rollout_id"] for m in members
    )
    again = (await api.post("/v1/runs/r1/work", json={"max_prompts": 1})).json()
    assert [(p["prompt_id"], p["attempt"]) for p in again["prompts"]] == [("p", 2)]


async def test_zero_variance_is_judged_at_the_last_score(api, redis, prefix):
    await make_run(api, "r1", group_size=2, drop_zero_variance_groups=True)
    await post(api, "r1", rollout("a", group="g", reward=1.0), rollout("b", group="g", reward=None))
    await post(
        api, "r1", rollout("c", group="h", reward=None), rollout("d", group="h", reward=None)
    )
    await score(api, "r1", {"b": 1.0, "c": 0.0, "d": 1.0})
    assert (await retired(redis, prefix, "r1")) == {"zero_variance": ["a", "b"]}
    got = await lease(api, "r1", 2)
    assert sorted(r["rollout_id"] for r in got.json()["rollouts"]) == ["c", "d"]


async def test_a_rewind_and_a_close_retire_awaiting_rollouts(api, redis, prefix):
    await make_run(api, "r1", max_staleness=4)
    await set_policy(api, "r1", 2)
    await post(api, "r1", rollout("old", 1, reward=None), rollout("new", 2, reward=None))
    lid = (await reward_lease(api, "r1", 2)).json()["lease_id"]
    resp = await api.post("/v1/runs/r1/policy", json={"version": 1, "rewind": True})
    assert resp.status_code == 200, resp.text
    assert (await retired(redis, prefix, "r1")) == {"rewound": ["new"]}
    # The lease keeps the rollout still there; a score of the rewound one is told it retired.
    resp = await score(api, "r1", {"old": 1.0, "new": 1.0}, lease_id=lid)
    assert resp.json() == {"scored": 1, "duplicates": 0, "retired": ["new"]}
    await post(api, "r1", rollout("late", 1, reward=None))
    assert (await api.post("/v1/runs/r1/close")).status_code == 200
    await api.post("/v1/runs/r1/rewards/lease", json={"max_rollouts": 1})  # sweeps
    got = await retired(redis, prefix, "r1")
    assert got.get("run_closed") and "late" in got["run_closed"], got
    assert await redis.hlen(run_key(prefix, "r1", AWAITING)) == 0


async def test_max_rollouts_takes_whole_units_oldest_first(api):
    await make_run(api, "r1", group_size=2)
    for g in "xyz":
        await post(
            api,
            "r1",
            rollout(f"{g}1", group=g, reward=None),
            rollout(f"{g}2", group=g, reward=None),
        )
    assert rids(await reward_lease(api, "r1", 3)) == ["x1", "x2"]  # the next group would be 4
    assert rids(await reward_lease(api, "r1", 4)) == ["y1", "y2", "z1", "z2"]


async def test_a_reward_worker_long_poll_is_woken_by_a_post(api, redis, prefix):
    await make_run(api, "r1")
    await make_run(api, "quiet")
    waiting = asyncio.create_task(reward_lease(api, "r1", 1, wait_s=20))
    await until_long_polling(redis, prefix, "r1", REWARD_WAITING)
    idle = asyncio.create_task(reward_lease(api, "quiet", 1, wait_s=3))
    await post(api, "r1", rollout("a", reward=None))
    got = await answered_before(waiting, idle)
    assert rids(got) == ["a"]


async def test_a_work_leased_rollout_comes_with_its_prompt_in_json_and_msgpack(api):
    await make_run(api, "r1")
    prompt = {"prompt_id": "p", "prompt_ids": [7, 8, 9], "data": {"answer": 42}}
    await api.post("/v1/runs/r1/prompts", json={"prompts": [prompt]})
    work = (await api.post("/v1/runs/r1/work", json={"max_prompts": 1})).json()
    gid = work["prompts"][0]["group_id"]
    one = {
        "rollout_id": "x",
        "group_id": gid,
        "policy_version": 0,
        "response_ids": [1, 2],
        "loss_mask": [1, 0],
    }
    assert (await post(api, "r1", one)).json()["accepted"] == 1
    body = {"max_rollouts": 1, "lease_id": "lease-0001"}
    got = (await reward_lease(api, "r1", 1, lease_id="lease-0001")).json()["rollouts"][0]
    assert got["prompt_id"] == "p" and got["data"] == {"answer": 42}
    assert got["prompt_ids"] == [7, 8, 9] and got["loss_mask"] == [1, 0]
    resp = await api.post(
        "/v1/runs/r1/rewards/lease",
        content=msgpack.packb(body),
        headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
    )
    packed = msgpack.unpackb(resp.content)["rollouts"][0]
    assert np.frombuffer(packed["prompt_ids"], "<i4").tolist() == [7, 8, 9]
    assert np.frombuffer(packed["response_ids"], "<i4").tolist() == [1, 2]
    assert np.frombuffer(packed["loss_mask"], "u1").tolist() == [1, 0]


async def test_a_reward_lease_obeys_the_brokers_request_bounds(api, settings):
    await make_run(api, "r1")
    big = settings.max_rollouts_per_request + 1
    detail = assert_error(await reward_lease(api, "r1", big), 422, "ValidationFailed")
    assert f"{big} rollouts in one request" in detail
    slow = settings.max_wait_s + 1
    detail = assert_error(await reward_lease(api, "r1", 1, wait_s=slow), 422, "ValidationFailed")
    assert "above the longest wait" in detail
