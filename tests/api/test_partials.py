"""Prompts of leased rollouts and partial rollouts (SPEC "Batches", "Prompts" → "Partial
rollouts"): the lease answer names each work rollout's prompt; prompts given back with what was
sampled so far come back with the next work lease, whose generator continues them."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import numpy as np

from app import keys
from tests.api.support import assert_error, events
from tests.api.test_prompts import register, work
from tests.helpers import lease, make_run, post, rollout


def answer(rid: str, gid: str, *, prompt: bool = True, tokens: int = 3) -> dict[str, Any]:
    r = rollout(rid, 0, group=gid, tokens=tokens)
    if not prompt:
        del r["prompt_ids"]
    return r


# -- the prompt of a leased rollout ----------------------------------------------------------
async def test_a_lease_names_each_work_rollouts_prompt_and_its_registered_tokens(api):
    await make_run(api, "r", group_size=2)
    await register(api, "r", "a", prompt_ids=[7, 8, 9])
    await register(api, "r", "b")
    got = await work(api, "r", 2)
    assert got is not None
    pa, pb = got["prompts"]
    # One member posts no prompt_ids (it gets the registered ones), one its own.
    resp = await post(
        api,
        "r",
        answer("a0", pa["group_id"], prompt=False),
        answer("a1", pa["group_id"]),
        answer("b0", pb["group_id"], prompt=False),
        answer("b1", pb["group_id"], prompt=False),
    )
    assert resp.status_code == 202, resp.text
    await post(api, "r", answer("free0", "free", prompt=False), answer("free1", "free"))
    resp = await lease(api, "r", 6)
    assert resp.status_code == 200, resp.text
    by_id = {r["rollout_id"]: r for r in resp.json()["rollouts"]}
    assert by_id["a0"]["prompt_id"] == "a" and by_id["a0"]["prompt_ids"] == [7, 8, 9]
    assert by_id["a1"]["prompt_id"] == "a" and by_id["a1"]["prompt_ids"] == [1, 2, 3]
    # A prompt registered without tokens: named, and no tokens to fill in.
    assert by_id["b0"]["prompt_id"] == "b" and by_id["b0"]["prompt_ids"] is None
    # A group of a generator working on its own names no prompt.
    assert "prompt_id" not in by_id["free0"] and by_id["free0"]["prompt_ids"] is None
    assert by_id["free1"]["prompt_ids"] == [1, 2, 3]


async def test_a_msgpack_lease_and_a_retried_one_carry_the_same_prompts(api):
    await make_run(api, "r")
    await register(api, "r", "a", prompt_ids=[70000, 5])
    got = await work(api, "r", 1)
    assert got is not None
    await post(api, "r", answer("a0", got["prompts"][0]["group_id"], prompt=False))
    params = {"size": 1, "batch_id": "batch-one"}
    first = await api.get("/v1/runs/r/batch", params=params)
    again = await api.get(
        "/v1/runs/r/batch", params=params, headers={"accept": "application/msgpack"}
    )
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["rollouts"][0]["prompt_id"] == "a"
    assert first.json()["rollouts"][0]["prompt_ids"] == [70000, 5]
    row = msgpack.unpackb(again.content, raw=False)["rollouts"][0]
    assert row["prompt_id"] == "a"
    assert np.frombuffer(row["prompt_ids"], dtype="<i4").tolist() == [70000, 5]


# -- partial rollouts ------------------------------------------------------------------------
def partial(rid: str, gid: str, tokens: list[int], version: int = 0) -> dict[str, Any]:
    """What a generator sampled so far of one response: a rollout without reward."""
    return {
        "rollout_id": rid,
        "group_id": gid,
        "policy_version": version,
        "response_ids": tokens,
        "logprobs": [-0.25 - i / 8 for i in range(len(tokens))],
        "finish_reason": "abort",
    }


def completed(p: dict[str, Any], more: list[int], reward: float = 1.0) -> dict[str, Any]:
    """A handed-out partial continued by ``more`` tokens, ready to post."""
    return {
        "rollout_id": p["rollout_id"],
        "group_id": p["group_id"],
        "policy_version": p["policy_version"],
        "response_ids": p["response_ids"] + more,
        "logprobs": p["logprobs"] + [-1.0] * len(more),
        "reward": reward,
        "finish_reason": "stop",
    }


async def give_back(
    api: httpx.AsyncClient, run: str, lid: str, *partials: dict[str, Any], **body: Any
) -> httpx.Response:
    return await api.post(
        f"/v1/runs/{run}/work/{lid}/return", json={**body, "partials": list(partials)}
    )


async def partial_events(redis, prefix: str, run: str) -> list[tuple[str, str | None, list]]:
    return [
        (d["change"], d.get("reason"), sorted(item[0] for item in d["items"]))
        for e, d in await events(redis, prefix, run)
        if e == "partials"
    ]


async def returned_with_partials(api, run: str = "r", **config: Any) -> dict[str, Any]:
    """A run of groups of 2, prompt 'a' handed to generator A, given back with two partials;
    the work lease that hands it out next (to generator B)."""
    await make_run(api, run, group_size=2, **config)
    await register(api, run, "a", prompt_ids=[5, 6])
    first = await work(api, run, 1, generator_id="gen-A")
    assert first is not None
    gid = first["prompts"][0]["group_id"]
    resp = await give_back(
        api,
        run,
        first["lease_id"],
        partial("a-0", gid, [11, 12, 13]),
        partial("a-1", gid, [21]),
        prompt_ids=["a"],
    )
    assert resp.status_code == 200 and resp.json() == {"returned": 1}, resp.text
    again = await work(api, run, 1, generator_id="gen-B")
    assert again is not None
    return again


async def test_partials_come_back_with_the_next_lease_and_complete_under_another_generator(
    api, redis, prefix
):
    again = await returned_with_partials(api)
    (p,) = again["prompts"]
    assert (p["prompt_id"], p["attempt"], p["group_id"]) == ("a", 2, "a#1.2")
    got = {q["rollout_id"]: q for q in p["partials"]}
    assert sorted(got) == ["a-0", "a-1"]
    assert got["a-0"]["response_ids"] == [11, 12, 13] and got["a-1"]["response_ids"] == [21]
    assert got["a-0"]["group_id"] == "a#1.2" and got["a-0"]["logprobs"] == [-0.25, -0.375, -0.5]
    assert "reward" not in got["a-0"]

    resp = await post(api, "r", completed(got["a-0"], [14, 15]), completed(got["a-1"], [22], 0.0))
    assert resp.json() == {"accepted": 2, "duplicates": 0, "rejected": []}, resp.text
    batch = (await lease(api, "r", 2)).json()
    rows = {r["rollout_id"]: r for r in batch["rollouts"]}
    assert rows["a-0"]["response_ids"] == [11, 12, 13, 14, 15]
    assert rows["a-0"]["prompt_id"] == "a" and rows["a-0"]["prompt_ids"] == [5, 6]
    assert rows["a-1"]["response_ids"] == [21, 22]
    # Completed: nothing of them is kept any more.
    assert not await redis.exists(keys.member_key(prefix, "r", keys.PARTIALS, "a#1"))
    assert await partial_events(redis, prefix, "r") == [
        ("returned", None, ["a-0", "a-1"]),
        ("resumed", None, ["a-0", "a-1"]),
    ]


async def test_a_tampered_prefix_is_422_and_stores_nothing(api, redis, prefix):
    again = await returned_with_partials(api)
    p = {q["rollout_id"]: q for q in again["prompts"][0]["partials"]}["a-0"]
    other = {q["rollout_id"]: q for q in again["prompts"][0]["partials"]}["a-1"]
    tampered = [
        {**completed(p, [14]), "response_ids": [11, 99, 13, 14]},
        {**completed(p, [14]), "logprobs": [-0.25, -0.375, -0.75, -1.0]},
        {**completed(p, [14]), "policy_version": 1},
        {**completed(p, []), "response_ids": [11, 12], "logprobs": [-0.25, -0.375]},
        {k: v for k, v in completed(p, [14]).items() if k != "logprobs"},
    ]
    await api.post("/v1/runs/r/policy", json={"version": 1})
    for bad in tampered:
        resp = await post(api, "r", completed(other, [22]), bad)
        assert "prefix_mismatch" in assert_error(resp, 422, "ValidationFailed")
    assert not await redis.exists(keys.member_key(prefix, "r", keys.BLOB, "a-0"))
    assert not await redis.exists(keys.member_key(prefix, "r", keys.BLOB, "a-1"))
    assert await redis.scard(keys.run_key(prefix, "r", keys.SEEN)) == 0
    kept = await redis.hkeys(keys.member_key(prefix, "r", keys.PARTIALS, "a#1"))
    assert sorted(kept) == [b"a-0", b"a-1"]
    # The untampered continuation is taken.
    resp = await post(api, "r", completed(other, [22]), completed(p, [14]))
    assert resp.json()["accepted"] == 2


async def test_a_partial_too_stale_to_hand_out_is_dropped_and_its_prompt_starts_afresh(
    api, redis, prefix
):
    await make_run(api, "r", group_size=2, max_staleness=1)
    await register(api, "r", "a")
    first = await work(api, "r", 1)
    assert first is not None
    gid = first["prompts"][0]["group_id"]
    await api.post("/v1/runs/r/policy", json={"version": 1})
    resp = await give_back(
        api, "r", first["lease_id"], partial("old", gid, [1, 2]), partial("new", gid, [3], 1)
    )
    assert resp.status_code == 200, resp.text
    await api.post("/v1/runs/r/policy", json={"version": 2})  # v0 is now too stale, v1 is not
    again = await work(api, "r", 1)
    assert again is not None
    assert [q["rollout_id"] for q in again["prompts"][0]["partials"]] == ["new"]
    await api.post("/v1/runs/r/policy", json={"version": 3})
    resp = await give_back(api, "r", again["lease_id"])  # "new" comes back with its prompt
    assert resp.status_code == 200, resp.text
    third = await work(api, "r", 1)
    assert third is not None and third["prompts"][0]["partials"] == []
    assert not await redis.exists(keys.member_key(prefix, "r", keys.PARTIALS, "a#1"))
    assert await partial_events(redis, prefix, "r") == [
        ("returned", None, ["new", "old"]),
        ("dropped", "stale", ["old"]),
        ("resumed", None, ["new"]),
        ("returned", None, ["new"]),
        ("dropped", "stale", ["new"]),
    ]


async def test_a_return_with_partials_breaking_a_rule_is_422_and_returns_nothing(
    api, redis, prefix
):
    await make_run(api, "r", group_size=2)
    await register(api, "r", "a", "b")
    got = await work(api, "r", 2)
    assert got is not None
    lid = got["lease_id"]
    ga, gb = (p["group_id"] for p in got["prompts"])
    await post(api, "r", rollout("posted", 0, group=gb))
    cases = [
        ((partial("x", "a#1.7", [1]),), {}, "partial_not_in_lease"),
        ((partial("x", gb, [1]),), {"prompt_ids": ["a"]}, "partial_not_returned"),
        ((partial("x", ga, [1]), partial("x", ga, [2])), {}, "duplicate_partial"),
        ((partial("posted", gb, [1]),), {}, "partial_posted"),
        ((partial("x", ga, [1], version=3),), {}, "partial_future_version"),
        (tuple(partial(f"x{i}", ga, [1]) for i in range(3)), {}, "too_many_partials"),
        (({**partial("x", ga, [1]), "reward": 1.0},), {}, "reward"),
        (({k: v for k, v in partial("x", ga, [1]).items() if k != "group_id"},), {}, "group_id"),
        (({**partial("x", ga, [1]), "logprobs": [0.5]},), {}, "logprobs"),
    ]
    for partials, body, rule in cases:
        resp = await give_back(api, "r", lid, *partials, **body)
        assert rule in assert_error(resp, 422, "ValidationFailed"), (rule, resp.text)
    assert await redis.zcard(keys.run_key(prefix, "r", keys.PROMPT_QUEUE)) == 0
    assert not await redis.exists(keys.member_key(prefix, "r", keys.PARTIALS, "a#1"))
    # A retried return after the first was answered: its partials of prompts already back
    # are left alone.
    assert (await give_back(api, "r", lid, partial("y", ga, [1]))).json() == {"returned": 2}
    assert (await give_back(api, "r", lid, partial("z", ga, [1]))).json() == {"returned": 0}
    kept = await redis.hkeys(keys.member_key(prefix, "r", keys.PARTIALS, "a#1"))
    assert kept == [b"y"]


async def test_a_partial_keeps_its_mask_and_versions_and_the_prefix_check_compares_them(api):
    await make_run(api, "r")
    await register(api, "r", "a")
    await api.post("/v1/runs/r/policy", json={"version": 1})
    first = await work(api, "r", 1)
    assert first is not None
    gid = first["prompts"][0]["group_id"]
    sampled = {
        **partial("m", gid, [1, 2, 3]),
        "loss_mask": [1, 0, 1],  # a tool token in the middle
        "versions": [[0, 0], [2, 1]],  # the third token under version 1
    }
    assert (await give_back(api, "r", first["lease_id"], sampled)).json() == {"returned": 1}
    again = await work(api, "r", 1)
    assert again is not None
    (p,) = again["prompts"][0]["partials"]
    assert (p["loss_mask"], p["versions"]) == ([1, 0, 1], [[0, 0], [2, 1]])
    good = {**completed(p, [4]), "loss_mask": [1, 0, 1, 1], "versions": p["versions"]}
    for bad in (
        {**good, "loss_mask": [1, 1, 1, 1]},
        {**good, "versions": [[0, 0], [3, 1]]},
        {k: v for k, v in good.items() if k != "versions"},
    ):
        resp = await post(api, "r", bad)
        assert "prefix_mismatch" in assert_error(resp, 422, "ValidationFailed"), resp.text
    assert (await post(api, "r", good)).json()["accepted"] == 1
