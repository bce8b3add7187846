"""Following the policy version: weights kept with each version, and the version long poll
(GET /v1/runs/{run_id}/policy?after=V&wait_s=T) woken by a change made on another process."""

from __future__ import annotations

import asyncio
from datetime import datetime

import httpx
import pytest
from redis.asyncio import Redis

from app.keys import POLICY_WAITING, run_key
from tests.api.support import assert_error, set_policy
from tests.helpers import answered_before, make_run, until_long_polling

URI = "s3://ckpt/run-1/step-100"


async def _policy(api: httpx.AsyncClient, run_id: str, **params: float) -> httpx.Response:
    return await api.get(f"/v1/runs/{run_id}/policy", params=params)


async def test_weights_are_kept_with_their_version(api, redis, prefix):
    await make_run(api, "r1")
    got = (await _policy(api, "r1")).json()
    assert got["policy_version"] == 0 and got["weights"] is None
    created = (await api.get("/v1/runs/r1")).json()["created_at"]
    assert got["set_at"] == created  # the version the run was created with

    body = {"version": 3, "weights": URI}
    resp = await api.post("/v1/runs/r1/policy", json=body)
    assert resp.json() == {"policy_version": 3, "evicted": 0}
    got = (await _policy(api, "r1")).json()
    assert (got["policy_version"], got["weights"]) == (3, URI)
    assert got["set_at"].endswith("Z")  # as created_at: ISO-8601, UTC, to the millisecond
    set_at = datetime.fromisoformat(got["set_at"].replace("Z", "+00:00"))
    assert set_at >= datetime.fromisoformat(created.replace("Z", "+00:00"))
    assert (await redis.hget(run_key(prefix, "r1"), "vat")) is not None

    # The same version again changes nothing, its weights and time included.
    again = await api.post("/v1/runs/r1/policy", json={"version": 3, "weights": "elsewhere"})
    assert again.json() == {"policy_version": 3, "evicted": 0}
    assert (await _policy(api, "r1")).json() == got

    # A version told without weights has none: the previous ones belong to the previous version.
    await set_policy(api, "r1", 4)
    got = (await _policy(api, "r1")).json()
    assert (got["policy_version"], got["weights"]) == (4, None)


async def test_the_audit_entry_names_the_weights(api):
    await make_run(api, "r1")
    await api.post("/v1/runs/r1/policy", json={"version": 1, "weights": URI})
    await set_policy(api, "r1", 2)
    page = (await api.get("/v1/audit")).json()
    details = [e["detail"] for e in page["entries"] if e["action"] == "run.policy"]
    assert details == [{"version": 2}, {"version": 1, "weights": URI}]


@pytest.mark.parametrize(
    "body",
    [
        {"version": 1, "weights": "x" * 2049},
        {"version": 1, "weights": ""},
        {"version": 1, "weights": "a\nb"},
        {"version": 1, "weights": "a\x00b"},
        {"version": 1, "weights": 5},
        {"version": 1, "weights": ["x"]},
        {"version": 1, "rewind": "yes"},
        {"version": 1, "rewind": 1},
    ],
)
async def test_malformed_weights_or_rewind_are_422_and_change_nothing(api, body):
    await make_run(api, "r1")
    await api.post("/v1/runs/r1/policy", json={"version": 0, "weights": URI})
    before = (await _policy(api, "r1")).json()
    assert_error(await api.post("/v1/runs/r1/policy", json=body), 422, "ValidationFailed")
    assert (await _policy(api, "r1")).json() == before


async def test_weights_of_the_longest_length_are_kept(api):
    await make_run(api, "r1")
    longest = "w" * 2048
    await api.post("/v1/runs/r1/policy", json={"version": 1, "weights": longest})
    assert (await _policy(api, "r1")).json()["weights"] == longest


async def test_reading_the_policy_of_an_unknown_run_is_404(api):
    assert_error(await _policy(api, "nope"), 404, "RunNotFound")
    assert_error(await _policy(api, "nope", after=0, wait_s=1), 404, "RunNotFound")


@pytest.mark.parametrize(
    "params",
    [{"after": -1}, {"after": "x"}, {"wait_s": -1}, {"wait_s": "nan"}, {"wait_s": 3601}],
)
async def test_malformed_policy_queries_are_422(api, params):
    await make_run(api, "r1")
    assert_error(await _policy(api, "r1", **params), 422, "ValidationFailed")


async def test_the_long_poll_is_204_when_wait_s_passes_with_the_same_version(api):
    await make_run(api, "r1")
    await set_policy(api, "r1", 2)
    resp = await _policy(api, "r1", after=2, wait_s=0.2)
    assert resp.status_code == 204
    assert resp.content == b""


@pytest.mark.parametrize("after", [4, 6, 100])
async def test_a_version_other_than_after_answers_at_once(api, after):
    # Above after: a version the caller has not seen. Below: the run was rewound past it (the
    # caller is ahead of the run), which a follower learns at once too. Neither waits: with no
    # fallback re-check and nothing to wake it, a waiting poll would end only at its wait_s,
    # after a poll with a shorter one on a run nothing changes.
    await make_run(api, "r1")
    await make_run(api, "idle")
    await api.post("/v1/runs/r1/policy", json={"version": 5, "weights": URI})
    idle = asyncio.create_task(_policy(api, "idle", after=0, wait_s=5))
    answer = asyncio.create_task(_policy(api, "r1", after=after, wait_s=20))
    resp = await answered_before(answer, idle)
    assert resp.status_code == 200
    assert resp.json()["policy_version"] == 5 and resp.json()["weights"] == URI


async def test_the_long_poll_answers_when_another_process_moves_the_version(
    api_servers: list[str], redis: Redis, prefix: str
) -> None:
    # The processes re-check only when woken (tests/api/conftest.py): the poll must answer
    # before one on a run whose version does not move, with a shorter wait, ends; so the other
    # process's change woke it through pub/sub, not the last try at its deadline.
    a, b = api_servers
    async with httpx.AsyncClient(timeout=60) as c:
        for run in ("r1", "idle"):
            assert (await c.post(a + "/v1/runs", json={"run_id": run})).status_code == 201
        followers = [
            asyncio.create_task(c.get(a + "/v1/runs/r1/policy", params={"after": 0, "wait_s": 20}))
            for _ in range(3)
        ]
        await until_long_polling(redis, prefix, "r1", POLICY_WAITING)
        idle = asyncio.create_task(
            c.get(a + "/v1/runs/idle/policy", params={"after": 0, "wait_s": 10})
        )
        resp = await c.post(b + "/v1/runs/r1/policy", json={"version": 1, "weights": URI})
        assert resp.status_code == 200, resp.text
        first = await answered_before(followers[0], idle)
        # Every follower of the run on that process is woken by the one change, not one each.
        rest = await asyncio.wait_for(asyncio.gather(*followers[1:]), 10)
        for got in [first, *rest]:
            assert got.status_code == 200, got.text
            assert got.json()["policy_version"] == 1 and got.json()["weights"] == URI
        await c.post(b + "/v1/runs/idle/policy", json={"version": 1})  # ends the idle poll


async def test_a_rewind_wakes_the_followers_with_the_version_it_went_back_to(api, redis, prefix):
    await make_run(api, "r1")
    await make_run(api, "idle")
    await api.post("/v1/runs/r1/policy", json={"version": 3, "weights": "ckpt/3"})
    follower = asyncio.create_task(_policy(api, "r1", after=3, wait_s=20))
    await until_long_polling(redis, prefix, "r1", POLICY_WAITING)
    idle = asyncio.create_task(_policy(api, "idle", after=0, wait_s=10))
    body = {"version": 1, "weights": "ckpt/1", "rewind": True}
    assert (await api.post("/v1/runs/r1/policy", json=body)).json()["policy_version"] == 1
    got = await answered_before(follower, idle)
    assert got.status_code == 200
    assert (got.json()["policy_version"], got.json()["weights"]) == (1, "ckpt/1")
    page = (await api.get("/v1/audit")).json()
    (rewound,) = [e["detail"] for e in page["entries"] if e["action"] == "run.rewind"]
    assert rewound == {"version": 1, "weights": "ckpt/1"}
