"""Consumers over HTTP (SPEC "Consumers"): creation, reads and deletion, batches leased,
acked and nacked, long polls woken by a delivery, bad input refused with nothing changed, and a
policy trainer that a consumer never disturbs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from app.keys import CONSUMER_WAITING
from tests.api.support import JSON, MSGPACK, assert_error, set_policy
from tests.helpers import (
    ack,
    answered_before,
    lease,
    make_run,
    post,
    rollout,
    until_long_polling,
)

BASE = "/v1/runs/{run}/consumers"


async def create(api: httpx.AsyncClient, run: str = "r1", **body: Any) -> httpx.Response:
    body.setdefault("name", "rm")
    body.setdefault("source", "received")
    return await api.post(BASE.format(run=run), json=body)


async def clease(
    api: httpx.AsyncClient, size: int, run: str = "r1", name: str = "rm", **params: Any
) -> httpx.Response:
    url = f"{BASE.format(run=run)}/{name}/batch"
    return await api.get(url, params={"size": size, **params})


async def settle(
    api: httpx.AsyncClient, batch_id: str, how: str = "ack", run: str = "r1", name: str = "rm"
) -> httpx.Response:
    return await api.post(f"{BASE.format(run=run)}/{name}/batches/{batch_id}/{how}")


async def view(api: httpx.AsyncClient, run: str = "r1", name: str = "rm") -> dict[str, Any]:
    resp = await api.get(f"{BASE.format(run=run)}/{name}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def counts(v: dict[str, Any]) -> tuple[int, int, int, int, int]:
    return v["delivered"], v["acked"], v["dropped"], v["pending"], v["leased"]


async def test_create_read_and_delete(api):
    await make_run(api, "r1")
    resp = await create(api, max_lag=2)
    assert resp.status_code == 201, resp.text
    got = resp.json()
    assert got["created_at"].endswith("Z")
    del got["created_at"]
    assert got == {
        "name": "rm",
        "kind": "rollouts",
        "source": "received",
        "max_lag": 2,
        "min_margin": None,
        "pairs": None,
        "retention_rollouts": 100_000,
        "delivered": 0,
        "acked": 0,
        "dropped": 0,
        "pending": 0,
        "leased": 0,
    }
    assert (await create(api, max_lag=2)).status_code == 200  # the same again: idempotent
    assert_error(await create(api, max_lag=3), 409, "ConsumerConflict")
    assert_error(await create(api, "nope"), 404, "RunNotFound")
    assert_error(await api.get(f"{BASE.format(run='r1')}/other"), 404, "ConsumerNotFound")
    assert (await api.delete(f"{BASE.format(run='r1')}/rm")).status_code == 204
    assert_error(await api.delete(f"{BASE.format(run='r1')}/rm"), 404, "ConsumerNotFound")
    assert_error(await api.get(f"{BASE.format(run='r1')}/rm"), 404, "ConsumerNotFound")
    await api.post("/v1/runs/r1/close")
    assert_error(await create(api, name="late"), 409, "RunClosed")


@pytest.mark.one_node
@pytest.mark.parametrize(
    "body",
    [
        {"name": "a b"},
        {"name": "x" * 65},
        {"name": ""},
        {"kind": "votes"},
        {"source": "sampled"},
        {"max_lag": -1},
        {"retention_rollouts": 0},
        {"min_margin": 0.5},  # kind rollouts has no pairs
        {"pairs": "all"},
        {"kind": "preferences", "min_margin": -1},
        {"kind": "preferences", "pairs": "some"},
        {"kind": "preferences", "min_margin": float("inf")},
        {"color": "red"},
    ],
)
async def test_a_bad_config_is_refused_and_creates_nothing(api, body):
    await make_run(api, "r1", group_size=2)
    full = {"name": "rm", "source": "received", **body}
    body_bytes = json.dumps(full, allow_nan=True).encode()
    resp = await api.post(BASE.format(run="r1"), content=body_bytes, headers=JSON)
    assert_error(resp, 422, "ValidationFailed")
    name = full["name"] if isinstance(full["name"], str) and full["name"] else "rm"
    if " " not in name and len(name) <= 64:
        assert_error(await api.get(f"{BASE.format(run='r1')}/{name}"), 404, "ConsumerNotFound")


async def test_a_batch_carries_the_rollouts_as_posted_in_json_and_msgpack(api):
    await make_run(api, "r1")
    assert (await create(api)).status_code == 201
    await post(api, "r1", rollout("a", reward=0.5), rollout("b", reward=-1.0))
    resp = await clease(api, 1)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"batch_id", "lease_expires_at", "rollouts"}  # no pairs: kind rollouts
    (one,) = body["rollouts"]
    assert one["rollout_id"] == "a" and one["reward"] == 0.5
    assert one["response_ids"] == [10, 11, 12, 13] and one["prompt_ids"] == [1, 2, 3]
    assert one["versions"] == [[0, 0]] and one["policy_version"] == 0
    assert counts(await view(api)) == (2, 0, 0, 2, 1)

    accept = {"accept": MSGPACK["content-type"]}
    packed = await api.get(f"{BASE.format(run='r1')}/rm/batch", params={"size": 5}, headers=accept)
    assert packed.headers["content-type"] == MSGPACK["content-type"]
    doc = msgpack.unpackb(packed.content, raw=False)
    (two,) = doc["rollouts"]
    assert two["rollout_id"] == "b" and two["reward"] == -1.0
    assert np.frombuffer(two["response_ids"], "<i4").tolist() == [10, 11, 12, 13]
    assert np.frombuffer(two["logprobs"], "<f4").size == 4

    assert (await settle(api, body["batch_id"])).json() == {"acked": 1}
    assert (await settle(api, body["batch_id"])).json() == {"acked": 1}  # a repeat
    assert (await settle(api, doc["batch_id"], "nack")).json() == {"returned": 1}
    assert (await settle(api, doc["batch_id"], "nack")).json() == {"returned": 1}
    assert_error(await settle(api, doc["batch_id"]), 409, "BatchSettled")
    assert_error(await settle(api, body["batch_id"], "nack"), 409, "BatchSettled")
    assert_error(await settle(api, "b" * 16), 404, "BatchNotFound")
    assert counts(await view(api)) == (2, 1, 0, 1, 0)
    again = await clease(api, 5)
    assert [r["rollout_id"] for r in again.json()["rollouts"]] == ["b"]
    assert (await clease(api, 5)).status_code == 204


async def test_a_client_chosen_batch_id_makes_the_lease_safe_to_retry(api):
    await make_run(api, "r1")
    await create(api)
    await post(api, "r1", rollout("a"), rollout("b"))
    first = await clease(api, 1, batch_id="retry-0001")
    again = await clease(api, 1, batch_id="retry-0001")
    assert first.json()["rollouts"] == again.json()["rollouts"]
    assert counts(await view(api))[4] == 1  # one lease, one item
    await settle(api, "retry-0001")
    assert_error(await clease(api, 1, batch_id="retry-0001"), 409, "BatchSettled")


@pytest.mark.one_node
async def test_lease_bounds_are_refused(api, settings):
    await make_run(api, "r1")
    await create(api)
    assert_error(await clease(api, settings.max_batch_size + 1), 422, "ValidationFailed")
    assert_error(await clease(api, 1, wait_s=settings.max_wait_s + 1), 422, "ValidationFailed")
    assert_error(await clease(api, 0), 422, "ValidationFailed")
    assert_error(await clease(api, 1, name="nobody"), 404, "ConsumerNotFound")
    assert_error(await clease(api, 1, run="nope"), 404, "RunNotFound")


async def test_a_long_poll_is_woken_by_a_delivery(api, redis, prefix):
    await make_run(api, "r1")
    await make_run(api, "quiet")
    await create(api)
    await create(api, "quiet")
    waiting = asyncio.create_task(clease(api, 1, wait_s=20))
    await until_long_polling(redis, prefix, "r1", CONSUMER_WAITING)
    idle = asyncio.create_task(clease(api, 1, run="quiet", wait_s=3))
    await post(api, "r1", rollout("a"))
    got = await answered_before(waiting, idle)
    assert [r["rollout_id"] for r in got.json()["rollouts"]] == ["a"]


async def test_a_consumer_changes_nothing_the_trainer_sees(api):
    await make_run(api, "r1", max_reuse=2)
    await create(api)
    await create(api, name="trained", source="trained")
    await post(api, "r1", rollout("a"), rollout("b"))
    c = (await clease(api, 2)).json()
    await settle(api, c["batch_id"])
    b1 = (await lease(api, "r1", 2)).json()
    assert {r["rollout_id"]: r["uses"] for r in b1["rollouts"]} == {"a": 0, "b": 0}
    assert (await clease(api, 2, name="trained")).status_code == 204  # not trained yet
    await ack(api, "r1", b1["batch_id"])
    t = (await clease(api, 2, name="trained")).json()
    assert sorted(r["rollout_id"] for r in t["rollouts"]) == ["a", "b"]
    b2 = (await lease(api, "r1", 2)).json()
    assert {r["rollout_id"]: r["uses"] for r in b2["rollouts"]} == {"a": 1, "b": 1}


async def test_received_items_outlive_staleness_within_max_lag(api):
    await make_run(api, "r1", max_staleness=0)
    await create(api, name="near", max_lag=1)
    await create(api, name="any")
    await post(api, "r1", rollout("a"))
    await set_policy(api, "r1", 2)  # 'a' is too stale to train on; near allows a lag of 1
    assert (await lease(api, "r1", 1)).status_code == 204
    assert (await clease(api, 1, name="near")).status_code == 204
    assert counts(await view(api, name="near"))[2] == 1  # dropped, counted
    got = (await clease(api, 1, name="any")).json()
    assert [r["rollout_id"] for r in got["rollouts"]] == ["a"]


async def test_pairs_of_a_group_in_json_and_msgpack(api):
    await make_run(api, "r1", group_size=3)
    body = {"name": "dpo", "kind": "preferences", "pairs": "all", "min_margin": 0.5}
    made = await create(api, **body)
    assert made.status_code == 201, made.text
    assert (made.json()["min_margin"], made.json()["pairs"]) == (0.5, "all")
    rewards = {"a": 1.0, "b": 0.75, "c": -0.5}
    await post(api, "r1", *(rollout(k, group="g", reward=w) for k, w in rewards.items()))
    resp = await clease(api, 10, name="dpo")
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert set(got) == {"batch_id", "lease_expires_at", "pairs"}
    pairs = {(p["chosen"]["rollout_id"], p["rejected"]["rollout_id"]): p for p in got["pairs"]}
    assert {k: p["margin"] for k, p in pairs.items()} == {("a", "c"): 1.5, ("b", "c"): 1.25}
    one = pairs[("a", "c")]
    assert one["chosen"]["reward"] == 1.0 and one["rejected"]["response_ids"] == [10, 11, 12, 13]
    assert len({p["pair_id"] for p in got["pairs"]}) == 2
    assert (await settle(api, got["batch_id"], "nack", name="dpo")).json() == {"returned": 2}
    accept = {"accept": MSGPACK["content-type"]}
    url = f"{BASE.format(run='r1')}/dpo/batch"
    packed = msgpack.unpackb((await api.get(url, params={"size": 1}, headers=accept)).content)
    (first,) = packed["pairs"]
    assert first["pair_id"] in {p["pair_id"] for p in got["pairs"]}  # the same id again
    assert np.frombuffer(first["chosen"]["response_ids"], "<i4").tolist() == [10, 11, 12, 13]
    assert (await settle(api, packed["batch_id"], name="dpo")).json() == {"acked": 1}
    v = await view(api, name="dpo")
    assert counts(v) == (2, 1, 0, 1, 0)


@pytest.mark.one_node
async def test_pairs_need_a_run_with_groups(api):
    await make_run(api, "r1")
    detail = assert_error(await create(api, kind="preferences"), 422, "ValidationFailed")
    assert "group_size" in detail
