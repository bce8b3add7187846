"""Prompts of leased rollouts and partial rollouts (SPEC "Batches", "Prompts" → "Partial
rollouts"): the lease answer names each work rollout's prompt; prompts given back with what was
sampled so far come back with the next work lease, whose generator continues them."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import numpy as np

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
