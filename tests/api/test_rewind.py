"""Rewinding a run to a checkpoint's version (SPEC "Policy versions" → "Resuming a trainer"):
what holds a token above it retires, the batches acked above it are undone, the prompt passes
they completed are trained again, the leases above it end, the budget counts from it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app import keys
from app.broker.store import RedisStore
from tests.api.support import assert_error, events, retired_items, set_policy
from tests.api.test_prompts import register, work
from tests.helpers import ack, lease, make_run, post, rollout


async def rewind(api: httpx.AsyncClient, run: str, version: int) -> dict[str, Any]:
    resp = await api.post(f"/v1/runs/{run}/policy", json={"version": version, "rewind": True})
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def answers(p: dict[str, Any], version: int, versions: list[list[int]] | None = None):
    """Both responses of a handed-out prompt (group_size 2); ``versions`` for the second."""
    out = [rollout(f"{p['prompt_id']}{i}", version, group=p["group_id"]) for i in range(2)]
    if versions is not None:
        out[1]["versions"] = versions
    return out


async def train(
    api: httpx.AsyncClient, run: str, version: int, bid: str, size: int = 8
) -> list[str]:
    """Lease what is ready (up to ``size``) at ``version`` as batch ``bid`` and ack it; the
    rollout ids."""
    resp = await lease(api, run, size, policy_version=version, batch_id=bid, partial=True)
    assert resp.status_code == 200, resp.text
    got = [r["rollout_id"] for r in resp.json()["rollouts"]]
    assert (await ack(api, run, bid)).status_code == 200
    return sorted(got)


async def pass_state(redis: Redis, prefix: str, run: str, pid: str) -> tuple[str, int, int]:
    st, att, tries = await redis.hmget(
        keys.member_key(prefix, run, keys.PASS, f"{pid}#1"), "st", "att", "tries"
    )
    return st.decode(), int(att), int(tries)


def free(name: str, version: int) -> list[dict[str, Any]]:
    """A group posted without a work lease."""
    return [rollout(f"{name}{i}", version, group=f"free-{name}") for i in range(2)]


async def history(api: httpx.AsyncClient) -> dict[str, Any]:
    """A run taken from version 8 to 12 with work leases, reuse (max_reuse 2) and a rollout
    sampled across a weight update; its work lease at 12, for the test to rewind."""
    await make_run(api, "r", group_size=2, max_reuse=2, max_staleness=4, order="fifo")
    await set_policy(api, "r", 8)
    await register(api, "r", "a", "b", "c", "d", "e")
    w8 = await work(api, "r", 3, generator_id="g8")
    assert w8 is not None
    pa, pb, pc = w8["prompts"]
    assert (await post(api, "r", *answers(pa, 8))).status_code == 202
    await set_policy(api, "r", 9)
    assert await train(api, "r", 9, "batch-09") == ["a0", "a1"]
    await set_policy(api, "r", 10)
    # c1 was sampled across the update to 10: its last tokens are version 10's.
    resp = await post(api, "r", *answers(pb, 8), *answers(pc, 8, versions=[[0, 8], [2, 10]]))
    assert resp.json()["accepted"] == 4, resp.text
    # a's second use (max_reuse: it retires), b's and c's first.
    assert await train(api, "r", 10, "batch-10") == ["a0", "a1", "b0", "b1", "c0", "c1"]
    await set_policy(api, "r", 11)
    w11 = await work(api, "r", 1, generator_id="g11")
    assert w11 is not None
    assert (await post(api, "r", *answers(w11["prompts"][0], 11))).status_code == 202
    assert await train(api, "r", 11, "batch-11") == ["b0", "b1", "c0", "c1", "d0", "d1"]
    assert (await post(api, "r", *free("h", 11))).status_code == 202
    held = await lease(api, "r", 8, policy_version=11, batch_id="held-at-11", partial=True)
    assert sorted(r["rollout_id"] for r in held.json()["rollouts"]) == ["d0", "d1", "h0", "h1"]
    await set_policy(api, "r", 12)
    w12 = await work(api, "r", 1, generator_id="g12")  # e, in flight when the run rewinds
    assert w12 is not None
    assert (await post(api, "r", *free("f", 12))).status_code == 202
    assert await train(api, "r", 12, "batch-12") == ["f0", "f1"]
    return {"w12": w12["lease_id"]}


async def test_a_rewind_undoes_what_happened_above_its_version(api, redis, prefix):
    seen = await history(api)
    before = len(await events(redis, prefix, "r"))

    # What is left holds tokens above 8: d and h (11, leased at 11), f (12).
    assert await rewind(api, "r", 8) == {"policy_version": 8, "evicted": 6}
    assert (await api.get("/v1/runs/r")).json()["policy_version"] == 8
    audit = (await api.get("/v1/audit", params={"run_id": "r", "limit": 1})).json()["entries"]
    assert [(e["action"], e["detail"]) for e in audit] == [("run.rewind", {"version": 8})]
    got = await retired_items(redis, prefix, "r")
    # [rollout, version, tokens, uses]: the uses of d and f were given back before they retired.
    assert sorted(got["rewound"]) == [
        ["d0", 11, 4, 0], ["d1", 11, 4, 0], ["f0", 12, 4, 0], ["f1", 12, 4, 0],
        ["h0", 11, 4, 0], ["h1", 11, 4, 0],
    ]  # fmt: skip
    # Every use of the batches acked at 9..12 is given back, one item per rollout per batch.
    new = (await events(redis, prefix, "r"))[before:]
    (undone,) = [d for e, d in new if e == "rewound"]
    assert (undone["from_version"], undone["to_version"]) == (12, 8)
    assert sorted(undone["batches"]) == ["batch-09", "batch-10", "batch-11", "batch-12"]
    assert sorted((i[0], i[3]) for i in undone["items"]) == [
        ("a0", 9), ("a0", 10), ("a1", 9), ("a1", 10), ("b0", 10), ("b0", 11), ("b1", 10),
        ("b1", 11), ("c0", 10), ("c0", 11), ("c1", 10), ("c1", 11), ("d0", 11),
        ("d1", 11), ("f0", 12), ("f1", 12),
    ]  # fmt: skip
    # The lease taken at 11 ended: its rollouts came back (and retired), its ack is 409.
    assert ("expired", "held-at-11") in [(e, d.get("batch_id")) for e, d in new]
    assert_error(await ack(api, "r", "held-at-11"), 409, "LeaseExpired")

    # Every pass an undone batch completed is queued again at a new attempt, and so is e,
    # whose work lease (taken at 12) ended; d's group was still buffered (in flight again at
    # attempt 2), then retired rewound (queued at 3). None of it was a try.
    for pid in "abce":
        assert await pass_state(redis, prefix, "r", pid) == ("q", 2, 0), pid
    assert await pass_state(redis, prefix, "r", "d") == ("q", 3, 0)
    w12 = await redis.hget(keys.member_key(prefix, "r", keys.WORK, seen["w12"]), "st")
    assert w12 == b"r"
    # ... and trained again.
    again = await work(api, "r", 5)
    assert again is not None
    assert sorted(p["prompt_id"] for p in again["prompts"]) == ["a", "b", "c", "d", "e"]
    assert sorted(p["attempt"] for p in again["prompts"]) == [2, 2, 2, 2, 3]


async def test_a_buffered_group_gets_its_use_back_and_its_pass_is_trained_again(api, redis, prefix):
    """max_reuse 3: the group is still buffered after the undone use, so its pass waits for it
    (in flight, at a new attempt) instead of generating it again; a lease taken below the
    rewind's version and kept across it acks with the use it gave back."""
    await make_run(api, "r", group_size=2, max_reuse=3, max_staleness=4)
    await register(api, "r", "p")
    got = await work(api, "r", 1)
    assert got is not None
    assert (await post(api, "r", *answers(got["prompts"][0], 0))).status_code == 202
    await set_policy(api, "r", 1)
    assert await train(api, "r", 0, "batch-at-0") == ["p0", "p1"]  # kept: acked at 0
    assert await train(api, "r", 1, "batch-at-1") == ["p0", "p1"]  # undone
    assert await pass_state(redis, prefix, "r", "p") == ("d", 1, 0)
    held = await lease(api, "r", 2, policy_version=0, batch_id="held-at-0")
    assert [r["uses"] for r in held.json()["rollouts"]] == [2, 2]

    assert await rewind(api, "r", 0) == {"policy_version": 0, "evicted": 0}
    # One use stands (the batch acked at 0), so the pass stays done.
    assert await pass_state(redis, prefix, "r", "p") == ("d", 1, 0)
    assert (await ack(api, "r", "held-at-0")).status_code == 200
    resp = await lease(api, "r", 2, batch_id="next-at-0")
    # Two uses now (0's and the held lease's), not three: the undone one was given back.
    assert [r["uses"] for r in resp.json()["rollouts"]] == [2, 2]


def across(rid: str, versions: list[list[int]], **kw: Any) -> dict[str, Any]:
    """A rollout sampled across weight updates: ``versions`` run-length per token."""
    r = rollout(rid, versions[0][1], **kw)
    r["versions"] = versions
    return r


async def test_what_holds_a_token_above_the_version_retires_ready_leased_or_filling(
    api, redis, prefix
):
    """Judged by the newest trained token, not by policy_version (the oldest): a buffered
    rollout, one in a lease taken below the version (the lease ends), a group still filling."""
    await make_run(api, "r", max_staleness=4)
    await make_run(api, "g", max_staleness=4, group_size=2)
    for run in ("r", "g"):
        await set_policy(api, run, 10)
    resp = await post(
        api,
        "r",
        across("ready", [[0, 8], [2, 10]]),
        across("kept", [[0, 8], [2, 9]]),
        across("leased", [[0, 7], [3, 10]]),
    )
    assert resp.json()["accepted"] == 3, resp.text
    held = await lease(api, "r", 1, policy_version=7, batch_id="held-at-7")
    assert [r["rollout_id"] for r in held.json()["rollouts"]] == ["leased"]
    await post(api, "g", across("g0", [[0, 8], [1, 10]], group="open"))

    assert await rewind(api, "r", 9) == {"policy_version": 9, "evicted": 2}
    assert await rewind(api, "g", 9) == {"policy_version": 9, "evicted": 1}
    assert {
        k: sorted(i[0] for i in v) for k, v in (await retired_items(redis, prefix, "r")).items()
    } == {"rewound": ["leased", "ready"]}
    assert_error(await ack(api, "r", "held-at-7"), 409, "LeaseExpired")
    assert (await retired_items(redis, prefix, "g"))["rewound"] == [["g0", 8, 4, 0]]
    resp = await lease(api, "r", 4, partial=True)
    assert [r["rollout_id"] for r in resp.json()["rollouts"]] == ["kept"]


async def test_a_partial_with_a_token_above_the_version_is_dropped_when_handed_out(
    api, redis, prefix
):
    await make_run(api, "r", group_size=2, max_staleness=4)
    await register(api, "r", "a")
    await set_policy(api, "r", 3)
    first = await work(api, "r", 1)
    assert first is not None
    gid = first["prompts"][0]["group_id"]
    old = {**rollout("a-old", 2, group=gid), "finish_reason": "abort"}
    new = {**across("a-new", [[0, 2], [2, 3]], group=gid), "finish_reason": "abort"}
    for p in (old, new):
        del p["reward"]
    resp = await api.post(
        f"/v1/runs/r/work/{first['lease_id']}/return", json={"partials": [old, new]}
    )
    assert resp.status_code == 200, resp.text
    await rewind(api, "r", 2)
    again = await work(api, "r", 1)
    assert again is not None
    (p,) = again["prompts"]
    assert [x["rollout_id"] for x in p["partials"]] == ["a-old"]
    dropped = [
        (d["reason"], [i[0] for i in d["items"]])
        for e, d in await events(redis, prefix, "r")
        if e == "partials" and d["change"] == "dropped"
    ]
    assert dropped == [("rewound", ["a-new"])]


async def test_the_kl_flush_floor_goes_back_to_before_the_flushes_above_the_version(
    api, redis, prefix
):
    await make_run(api, "r", max_staleness=5, max_reuse=3, kl_max=10, kl_flush=0.1)
    await set_policy(api, "r", 2)
    await post(api, "r", rollout("x", 2))
    b = (await lease(api, "r", 1, batch_id="flush-at-2")).json()
    await ack(api, "r", b["batch_id"], kl={"x": 1.0})  # floor 2
    await set_policy(api, "r", 4)
    await post(api, "r", rollout("y", 4))
    b = (await lease(api, "r", 1, batch_id="flush-at-4")).json()
    await ack(api, "r", b["batch_id"], kl={"y": 1.0})  # floor 4
    floor = keys.run_key(prefix, "r")
    assert await redis.hget(floor, "floor") == b"4"
    await rewind(api, "r", 3)
    assert await redis.hget(floor, "floor") == b"2"
    # A rollout of version 2 is not below the floor any more; one of 1 still is.
    resp = await post(api, "r", rollout("two", 2), rollout("one", 1))
    assert resp.json()["rejected"] == [{"rollout_id": "one", "reason": "stale"}], resp.text


async def test_rewind_to_the_current_or_a_later_version_is_the_plain_change(api, redis, prefix):
    await make_run(api, "r")
    await set_policy(api, "r", 3)
    assert await rewind(api, "r", 3) == {"policy_version": 3, "evicted": 0}
    assert await rewind(api, "r", 5) == {"policy_version": 5, "evicted": 0}
    assert not [e for e, _ in await events(redis, prefix, "r") if e == "rewound"]


@pytest.mark.parametrize(
    "body", [{"version": 1, "rewind": "yes"}, {"version": 1, "rewind": 1}, {"rewind": True}]
)
async def test_a_bad_rewind_is_422_and_changes_nothing(api, body):
    await make_run(api, "r")
    await set_policy(api, "r", 4)
    assert_error(await api.post("/v1/runs/r/policy", json=body), 422, "ValidationFailed")
    assert (await api.get("/v1/runs/r")).json()["policy_version"] == 4


async def test_a_closed_run_is_not_rewound(api):
    await make_run(api, "r")
    await set_policy(api, "r", 4)
    assert (await api.post("/v1/runs/r/close")).status_code == 200
    resp = await api.post("/v1/runs/r/policy", json={"version": 1, "rewind": True})
    assert_error(resp, 409, "RunClosed")
    assert (await api.get("/v1/runs/r")).json()["policy_version"] == 4
    assert_error(
        await api.post("/v1/runs/nope/policy", json={"version": 1, "rewind": True}),
        404,
        "RunNotFound",
    )


async def test_acked_batches_leave_the_rewind_index_with_their_records(api, redis, prefix):
    """The maintenance pass trims the index after 24 h, when the batch records expire: a
    rewind then has nothing to undo there, and the index does not grow without end."""
    await make_run(api, "r", max_reuse=3)
    await post(api, "r", rollout("x"))
    await set_policy(api, "r", 1)
    assert await train(api, "r", 1, "batch-old") == ["x"]
    assert await train(api, "r", 1, "batch-new") == ["x"]
    index = keys.run_key(prefix, "r", keys.ACKED)
    await redis.zadd(index, {"1:batch-old": 1})  # acked on 1 January 1970
    store = RedisStore(redis, prefix)
    [(_, token)] = await store.active_runs()
    await store.maintain("r", token)
    assert await redis.zrange(index, 0, -1) == [b"1:batch-new"]
