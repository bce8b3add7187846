"""Prompts and work leases through HTTP (SPEC "Prompts and admission control"): registration,
hand-out order, the staleness budget, return, expiry, and the done / retry / failed rules."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app import keys
from app.api import _codec as codec
from app.main import create_app
from tests.api.support import (
    asgi_client,
    assert_error,
    events,
    fail_over_before_first,
    replica_of,
    retired,
    set_policy,
)
from tests.helpers import ack, lease, make_run, post, rollout


async def register(
    api: httpx.AsyncClient, run: str, *pids: str, epochs: int | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"prompts": [{"prompt_id": p, **extra} for p in pids]}
    if epochs is not None:
        body["epochs"] = epochs
    resp = await api.post(f"/v1/runs/{run}/prompts", json=body)
    assert resp.status_code == 202, resp.text
    out: dict[str, Any] = resp.json()
    return out


async def work(api: httpx.AsyncClient, run: str, k: int, **body: Any) -> dict[str, Any] | None:
    resp = await api.post(f"/v1/runs/{run}/work", json={"max_prompts": k, **body})
    if resp.status_code == 204:
        return None
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


async def give_back(
    api: httpx.AsyncClient, run: str, lease_id: str, prompt_ids: list[str] | None = None
) -> httpx.Response:
    body = {} if prompt_ids is None else {"prompt_ids": prompt_ids}
    return await api.post(f"/v1/runs/{run}/work/{lease_id}/return", json=body)


def group(p: dict[str, Any], n: int, version: int = 0, rewards: list[float] | None = None):
    """n rollouts for a handed-out prompt, under its group_id."""
    rw = rewards or [float(i) for i in range(n)]
    return [
        rollout(f"{p['group_id']}/{i}", version, group=p["group_id"], reward=rw[i])
        for i in range(n)
    ]


def handed(lease_body: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [(p["prompt_id"], p["pass"], p["attempt"]) for p in lease_body["prompts"]]


async def expire_now(redis: Redis, prefix: str, run: str, lease_id: str) -> None:
    """Make a work lease's time run out now: its expiry, as the sweep reads it, in the past."""
    await redis.hset(keys.member_key(prefix, run, keys.WORK, lease_id), "exp", 1)
    await redis.zadd(keys.run_key(prefix, run, keys.WORK_LEASES), {lease_id: 1})


async def pass_events(redis: Redis, prefix: str, run: str) -> list[tuple[str, list[Any]]]:
    return [
        (d["cause"], item)
        for e, d in await events(redis, prefix, run)
        if e == "passes"
        for item in d["items"]
    ]


# -- registration -----------------------------------------------------------------------------
async def test_register_is_idempotent_by_prompt_id(api, redis, prefix):
    await make_run(api, "r")
    assert await register(api, "r", "a", "b", prompt_ids=[1, 2]) == {"accepted": 2, "duplicates": 0}
    again = await register(api, "r", "b", "c", data={"other": True})
    assert again == {"accepted": 1, "duplicates": 1}
    got = await work(api, "r", 10)
    assert got is not None
    # b kept what it was first registered with.
    by_id = {p["prompt_id"]: p for p in got["prompts"]}
    assert by_id["b"]["prompt_ids"] == [1, 2] and by_id["b"]["data"] is None
    assert by_id["c"]["data"] == {"other": True}
    regs = [d for e, d in await events(redis, prefix, "r") if e == "registered"]
    assert [item[0] for d in regs for item in d["items"]] == ["a", "b", "c"]


@pytest.fixture(params=[False, True], ids=["whole", "item by item"])
def streamed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """A registration parsed whole, or one prompt at a time as a big body is."""
    if request.param:
        monkeypatch.setattr(codec, "STREAM_BYTES", 0)
    return bool(request.param)


async def test_epochs_queue_every_pass_after_the_previous_one(api, streamed):
    await make_run(api, "r")
    await register(api, "r", "a", "b", epochs=3)
    got = await work(api, "r", 6)
    assert got is not None
    assert handed(got) == [
        ("a", 1, 1),
        ("b", 1, 1),
        ("a", 2, 1),
        ("b", 2, 1),
        ("a", 3, 1),
        ("b", 3, 1),
    ]
    assert [p["group_id"] for p in got["prompts"][:2]] == ["a#1.1", "b#1.1"]
    assert await work(api, "r", 1) is None


@pytest.mark.parametrize(
    ("body", "what"),
    [
        ({"prompts": [{"prompt_id": "a", "prompt_ids": [-1]}]}, "token ids"),
        ({"prompts": [{"prompt_id": "a", "prompt_ids": [1.5]}]}, "prompt_ids"),
        ({"prompts": [{"prompt_id": "a", "data": {"x": "y" * 70_000}}]}, "data is"),
        ({"prompts": [{"prompt_id": "a b"}]}, "prompt_id"),
        ({"prompts": [{"prompt_id": "x" * 201}]}, "prompt_id"),
        ({"prompts": [{"prompt_id": "a"}], "epochs": 0}, "epochs"),
        ({"prompts": [{"prompt_id": "a"}], "epochs": 1001}, "epochs"),
        ({"prompts": [{"prompt_id": "a", "extra": 1}]}, "extra"),
        ({"prompts": [{"prompt_id": "ok"}, {"prompt_id": "a", "prompt_ids": [2**40]}]}, "token"),
    ],
)
async def test_bad_prompts_are_422_and_register_nothing(api, body, what, streamed):
    await make_run(api, "r")
    resp = await api.post("/v1/runs/r/prompts", json=body)
    detail = assert_error(resp, 422, "ValidationFailed")
    assert what in detail
    assert await work(api, "r", 10) is None


async def test_too_many_prompts_in_one_request_is_422(api):
    await make_run(api, "r")
    n = api._transport.app.state.settings.max_prompts_per_request + 1  # type: ignore[attr-defined]
    resp = await api.post(
        "/v1/runs/r/prompts", json={"prompts": [{"prompt_id": f"p{i}"} for i in range(n)]}
    )
    assert "at most" in assert_error(resp, 422, "ValidationFailed")
    assert await work(api, "r", 10) is None


async def test_unknown_and_closed_runs(api):
    resp = await api.post("/v1/runs/nope/prompts", json={"prompts": [{"prompt_id": "a"}]})
    assert_error(resp, 404, "RunNotFound")
    assert_error(await api.post("/v1/runs/nope/work", json={"max_prompts": 1}), 404, "RunNotFound")
    await make_run(api, "r")
    await register(api, "r", "a")
    assert (await api.post("/v1/runs/r/close")).status_code == 200
    resp = await api.post("/v1/runs/r/prompts", json={"prompts": [{"prompt_id": "b"}]})
    assert_error(resp, 409, "RunClosed")
    assert_error(await api.post("/v1/runs/r/work", json={"max_prompts": 1}), 409, "RunClosed")


# -- work leases ------------------------------------------------------------------------------
async def test_a_retried_work_request_with_its_lease_id_gets_the_same_lease(api):
    await make_run(api, "r")
    await register(api, "r", "a", "b", "c")
    first = await work(api, "r", 2, lease_id="lease-0001", generator_id="g1")
    again = await work(api, "r", 2, lease_id="lease-0001", generator_id="g1")
    assert first == again and first is not None
    assert handed(first) == [("a", 1, 1), ("b", 1, 1)]
    other = await work(api, "r", 5)
    assert other is not None and handed(other) == [("c", 1, 1)]


async def test_a_retried_work_request_whose_lease_a_failover_lost_is_made_again(
    settings, redis, prefix, monkeypatch
):
    """A work lease made on a master that a failover replaced before its prompts were read: the
    read reached the promoted replica, which has neither the lease nor the prompts registered
    since it last replicated. The lease is made again there under the same lease id, rather than
    answered with a 500 (tests/api/test_batches.py has the same for a batch)."""
    app = create_app(settings)
    async with asgi_client(app) as api:
        await make_run(api, "r")
        await register(api, "r", "old")
        replica = await replica_of(redis, prefix, "r")
        await register(api, "r", "new")  # registered after the replica's last copy
        store = app.state.broker.store
        failovers = fail_over_before_first(
            monkeypatch, store, "prompt_blobs", redis, prefix, "r", replica
        )
        got = await work(api, "r", 2, lease_id="lease-0001")
        assert failovers == [["old", "new"]]
        assert got is not None and got["lease_id"] == "lease-0001"
        assert handed(got) == [("old", 1, 1)]
        assert (await give_back(api, "r", "lease-0001")).json() == {"returned": 1}


async def test_a_lease_id_of_a_returned_lease_is_409(api):
    await make_run(api, "r")
    await register(api, "r", "a")
    await work(api, "r", 1, lease_id="lease-0001")
    assert (await give_back(api, "r", "lease-0001")).json() == {"returned": 1}
    resp = await api.post("/v1/runs/r/work", json={"max_prompts": 1, "lease_id": "lease-0001"})
    assert "returned" in assert_error(resp, 409, "WorkLeaseOver")


async def test_returned_prompts_go_first_with_a_new_attempt_and_the_old_group_is_stale(
    api, redis, prefix
):
    await make_run(api, "r", group_size=2)
    await register(api, "r", "a", "b", "c")
    got = await work(api, "r", 2)
    assert got is not None
    a = got["prompts"][0]
    # Half of a's group is posted, then the generator gives a back unfinished.
    assert (await post(api, "r", *group(a, 2)[:1])).json()["accepted"] == 1
    resp = await give_back(api, "r", got["lease_id"], ["a"])
    assert resp.json() == {"returned": 1}
    # a comes back before c, which was never handed out; b is still in flight.
    again = await work(api, "r", 5)
    assert again is not None and handed(again) == [("a", 1, 2), ("c", 1, 1)]
    # The rest of the old attempt's group is rejected and recorded; its first half retired.
    out = (await post(api, "r", *group(a, 2)[1:])).json()
    assert out["rejected"] == [{"rollout_id": "a#1.1/1", "reason": "stale_attempt"}]
    rejected = [d for e, d in await events(redis, prefix, "r") if e == "rejected"]
    assert rejected[0]["items"][0][:2] == ["a#1.1/1", "stale_attempt"]
    retired = [d for e, d in await events(redis, prefix, "r") if e == "retired"]
    assert [(d["reason"], [i[0] for i in d["items"]]) for d in retired] == [
        ("incomplete_group", ["a#1.1/0"])
    ]
    # A return is not a try.
    assert ("returned", ["a", 1, 2, "queued", 0]) in await pass_events(redis, prefix, "r")


async def test_return_refuses_prompts_of_another_lease_and_unknown_leases(api):
    await make_run(api, "r")
    await register(api, "r", "a", "b")
    first = await work(api, "r", 1)
    second = await work(api, "r", 1)
    assert first is not None and second is not None
    resp = await give_back(api, "r", first["lease_id"], ["b"])
    assert "'b'" in assert_error(resp, 422, "ValidationFailed")
    assert_error(await give_back(api, "r", "no-such-lease"), 404, "WorkLeaseNotFound")
    # Nothing came back: there is nothing to hand out.
    assert await work(api, "r", 5) is None
    # Returning again what was returned already is harmless.
    assert (await give_back(api, "r", first["lease_id"], ["a"])).json() == {"returned": 1}
    assert (await give_back(api, "r", first["lease_id"], ["a"])).json() == {"returned": 0}


async def test_an_expired_work_lease_returns_its_unfinished_prompts_as_a_try(api, redis, prefix):
    await make_run(api, "r", group_size=2, max_attempts=2)
    await register(api, "r", "a", "b")
    got = await work(api, "r", 2)
    assert got is not None
    a, b = got["prompts"]
    await post(api, "r", *group(a, 2))  # a's group is complete: it is not the lease's any more
    await post(api, "r", *group(b, 2)[:1])  # b's is not
    await expire_now(redis, prefix, "r", got["lease_id"])
    again = await work(api, "r", 5)
    assert again is not None and handed(again) == [("b", 1, 2)]
    assert ("expired", ["b", 1, 2, "queued", 1]) in await pass_events(redis, prefix, "r")
    # Its second try expires too: with max_attempts 2, b has failed.
    await expire_now(redis, prefix, "r", again["lease_id"])
    assert await work(api, "r", 5) is None
    assert ("expired", ["b", 1, 2, "failed", 2]) in await pass_events(redis, prefix, "r")
    # a's complete group is still there for a trainer.
    batch = await lease(api, "r", 2)
    assert batch.status_code == 200


# -- done, retried, failed --------------------------------------------------------------------
async def test_a_pass_is_done_at_its_groups_first_acknowledged_use(api, redis, prefix):
    await make_run(api, "r", group_size=2, max_reuse=2)
    await register(api, "r", "a")
    got = await work(api, "r", 1)
    assert got is not None
    await post(api, "r", *group(got["prompts"][0], 2))
    for _ in range(2):
        batch = (await lease(api, "r", 2)).json()
        assert (await ack(api, "r", batch["batch_id"])).status_code == 200
    changes = await pass_events(redis, prefix, "r")
    assert changes == [("acked", ["a", 1, 1, "done", 0])]


async def test_a_group_that_retires_unused_sends_its_prompt_back_until_max_attempts(
    api, redis, prefix
):
    await make_run(api, "r", max_attempts=2, max_staleness=0)
    await register(api, "r", "a")
    for attempt in (1, 2):
        got = await work(api, "r", 1)
        assert got is not None and handed(got) == [("a", 1, attempt)]
        p = got["prompts"][0]
        await post(api, "r", rollout(f"x{attempt}", attempt - 1, group=p["group_id"]))
        await set_policy(api, "r", attempt)  # the rollout goes stale before any trainer used it
    assert await work(api, "r", 1) is None
    assert await pass_events(redis, prefix, "r") == [
        ("retired", ["a", 1, 2, "queued", 1]),
        ("retired", ["a", 1, 2, "failed", 2]),
    ]


async def test_a_work_rollout_rejected_stale_sends_its_prompt_back_at_once(api, redis, prefix):
    await make_run(api, "r", group_size=1, step_groups=1, max_staleness=0)
    await register(api, "r", "p0", "p1", "p2")
    got = await work(api, "r", 1)
    assert got is not None and handed(got) == [("p0", 1, 1)]
    p0 = got["prompts"][0]
    await set_policy(api, "r", 1)
    out = (await post(api, "r", rollout("p0-a", 0, group=p0["group_id"]))).json()
    assert out["accepted"] == 0 and out["rejected"] == [{"rollout_id": "p0-a", "reason": "stale"}]
    # The attempt is over: p0 is queued at its next attempt (a try, like a group that retires
    # unused), and its place in the budget is free: at version 1 two groups fit.
    assert await pass_events(redis, prefix, "r") == [("rejected", ["p0", 1, 2, "queued", 1])]
    again = await work(api, "r", 5)
    assert again is not None and handed(again) == [("p0", 1, 2), ("p1", 1, 1)]
    # A later rollout of the lost attempt is refused as such.
    late = (await post(api, "r", rollout("p0-b", 1, group=p0["group_id"]))).json()
    assert late["rejected"] == [{"rollout_id": "p0-b", "reason": "stale_attempt"}]


async def test_a_stale_member_retires_its_whole_attempt(api, redis, prefix):
    await make_run(api, "r", group_size=2, max_staleness=1, max_attempts=2)
    await register(api, "r", "a", "b")
    got = await work(api, "r", 2)
    assert got is not None
    a, b = got["prompts"]
    await set_policy(api, "r", 1)
    # Half of a's group comes in fresh; its other half comes in stale, after a step too many.
    assert (await post(api, "r", rollout("a-0", 1, group=a["group_id"]))).json()["accepted"] == 1
    await set_policy(api, "r", 2)
    out = (await post(api, "r", rollout("a-1", 0, group=a["group_id"]))).json()
    assert out["rejected"] == [{"rollout_id": "a-1", "reason": "stale"}]
    # The group can never complete: its first half retires and a goes back to the queue.
    assert await retired(redis, prefix, "r") == {"incomplete_group": ["a-0"]}
    # In one request, a stale member takes its fresh fellow with it; b's lease is now over.
    out = (
        await post(
            api,
            "r",
            rollout("b-0", 2, group=b["group_id"]),
            rollout("b-1", 0, group=b["group_id"]),
        )
    ).json()
    assert out["accepted"] == 0 and out["rejected"] == [
        {"rollout_id": "b-0", "reason": "stale_attempt"},
        {"rollout_id": "b-1", "reason": "stale"},
    ]
    assert await pass_events(redis, prefix, "r") == [
        ("rejected", ["a", 1, 2, "queued", 1]),
        ("rejected", ["b", 1, 2, "queued", 1]),
    ]
    # Neither prompt is the lease's any more: it is complete.
    lease_key = keys.member_key(prefix, "r", keys.WORK, got["lease_id"])
    assert await redis.hget(lease_key, "st") == b"c"
    again = await work(api, "r", 5)
    assert again is not None and handed(again) == [("a", 1, 2), ("b", 1, 2)]
    # Lost to staleness a second time, with max_attempts 2, a has failed.
    await set_policy(api, "r", 4)
    out = (await post(api, "r", rollout("a-2", 2, group=again["prompts"][0]["group_id"]))).json()
    assert out["rejected"] == [{"rollout_id": "a-2", "reason": "stale"}]
    assert ("rejected", ["a", 1, 2, "failed", 2]) in await pass_events(redis, prefix, "r")


async def test_a_zero_variance_group_is_done(api, redis, prefix):
    await make_run(api, "r", group_size=2, drop_zero_variance_groups=True)
    await register(api, "r", "a")
    got = await work(api, "r", 1)
    assert got is not None
    await post(api, "r", *group(got["prompts"][0], 2, rewards=[1.0, 1.0]))
    assert await pass_events(redis, prefix, "r") == [("retired", ["a", 1, 1, "done", 0])]
    assert await work(api, "r", 1) is None


# -- the staleness budget ---------------------------------------------------------------------
async def test_the_budget_admits_v_plus_max_staleness_plus_one_steps_of_groups(api):
    await make_run(api, "r", step_groups=2, max_staleness=1)
    await register(api, "r", *[f"p{i}" for i in range(20)])
    got = await work(api, "r", 10)
    assert got is not None and len(got["prompts"]) == 4  # (0 + 1 + 1) * 2
    assert await work(api, "r", 10) is None
    await set_policy(api, "r", 1)
    more = await work(api, "r", 10)
    assert more is not None and len(more["prompts"]) == 2


async def test_groups_that_retire_unused_free_their_budget_and_used_ones_do_not(api):
    await make_run(api, "r", step_groups=1, max_staleness=0, group_size=1)
    await register(api, "r", "a", "b", "c")
    got = await work(api, "r", 5)
    assert got is not None and handed(got) == [("a", 1, 1)]
    # Returned: the budget is free again, and a comes back first.
    await give_back(api, "r", got["lease_id"])
    got = await work(api, "r", 5)
    assert got is not None and handed(got) == [("a", 1, 2)]
    await post(api, "r", rollout("a-0", 0, group=got["prompts"][0]["group_id"]))
    batch = (await lease(api, "r", 1)).json()
    await ack(api, "r", batch["batch_id"])
    # a reached a gradient: it keeps counting, so at version 0 nothing more is admitted.
    assert await work(api, "r", 5) is None
    await set_policy(api, "r", 1)
    got = await work(api, "r", 5)
    assert got is not None and handed(got) == [("b", 1, 1)]


async def test_rollouts_posted_on_their_own_count_toward_the_budget(api):
    await make_run(api, "r", step_groups=1, max_staleness=0)
    await register(api, "r", "a")
    await post(api, "r", rollout("free", 0))
    assert await work(api, "r", 5) is None
    await api.post("/v1/runs/r/close")


async def test_raising_step_groups_admits_more_at_once(api):
    await make_run(api, "r", step_groups=1, max_staleness=0)
    await register(api, "r", "a", "b", "c")
    assert await work(api, "r", 5) is not None
    assert await work(api, "r", 5) is None
    resp = await api.patch("/v1/runs/r/config", json={"step_groups": 3})
    assert resp.status_code == 200
    got = await work(api, "r", 5)
    assert got is not None and len(got["prompts"]) == 2
    resp = await api.patch("/v1/runs/r/config", json={"step_groups": None})
    assert resp.json()["config"]["step_groups"] is None


@pytest.mark.parametrize(
    ("body", "what"),
    [
        ({"max_prompts": 1025}, "largest work lease"),
        ({"max_prompts": 0}, "max_prompts"),
        ({"max_prompts": 1, "lease_id": "short"}, "lease_id"),
        ({"max_prompts": 1, "wait_s": -1}, "wait_s"),
        ({"max_prompts": 1, "generator_id": "a b"}, "generator_id"),
        ({}, "max_prompts"),
    ],
)
async def test_bad_work_requests_are_422_and_hand_out_nothing(api, body, what):
    await make_run(api, "r")
    await register(api, "r", "a")
    resp = await api.post("/v1/runs/r/work", json=body)
    assert what in assert_error(resp, 422, "ValidationFailed")
    got = await work(api, "r", 5)
    assert got is not None and handed(got) == [("a", 1, 1)]


async def test_a_registration_is_bounded_in_prompt_passes(api):
    await make_run(api, "r")
    limit = api._transport.app.state.settings.max_prompts_per_request  # type: ignore[attr-defined]
    n = limit // 1000 + 1  # prompts that, at 1000 epochs each, make more passes than the limit
    prompts = [{"prompt_id": f"p{i}"} for i in range(n)]
    body = {"prompts": prompts, "epochs": 1000}
    detail = assert_error(await api.post("/v1/runs/r/prompts", json=body), 422, "ValidationFailed")
    assert "prompt passes" in detail
    assert await work(api, "r", 10) is None
    body["prompts"] = prompts[: limit // 1000]
    assert (await api.post("/v1/runs/r/prompts", json=body)).status_code == 202


async def test_a_retried_work_request_gets_only_the_prompts_its_lease_still_holds(api):
    await make_run(api, "r", group_size=1)
    await register(api, "r", "a", "b", "c")
    first = await work(api, "r", 3, lease_id="lease-0001")
    assert first is not None
    await post(api, "r", rollout("c-0", 0, group=first["prompts"][2]["group_id"]))
    assert (await give_back(api, "r", "lease-0001", ["a"])).json() == {"returned": 1}
    again = await work(api, "r", 3, lease_id="lease-0001")
    # a went back (another generator may hold it at its next attempt); b and c are still its own.
    assert again is not None and handed(again) == [("b", 1, 1), ("c", 1, 1)]
    # Given back one by one, the lease holds nothing more: a retry is refused like a returned one.
    assert (await give_back(api, "r", "lease-0001", ["b"])).json() == {"returned": 1}
    await api.post("/v1/runs/r/close")
    await make_run(api, "s")
    await register(api, "s", "a", "b")
    await work(api, "s", 2, lease_id="lease-0002")
    for pid in ("a", "b"):
        assert (await give_back(api, "s", "lease-0002", [pid])).json() == {"returned": 1}
    resp = await api.post("/v1/runs/s/work", json={"max_prompts": 2, "lease_id": "lease-0002"})
    assert "returned" in assert_error(resp, 409, "WorkLeaseOver")


async def test_a_work_lease_comes_as_msgpack_when_asked_for(api):
    import msgpack

    await make_run(api, "r")
    await register(api, "r", "a", prompt_ids=[5, 6, 7], data={"answer": 42})
    resp = await api.post(
        "/v1/runs/r/work", json={"max_prompts": 1}, headers={"accept": "application/msgpack"}
    )
    assert resp.headers["content-type"] == "application/msgpack"
    body = msgpack.unpackb(resp.content, raw=False)
    assert body["prompts"] == [
        {
            "prompt_id": "a",
            "pass": 1,
            "attempt": 1,
            "group_id": "a#1.1",
            "prompt_ids": [5, 6, 7],
            "data": {"answer": 42},
            "partials": [],
        }
    ]
