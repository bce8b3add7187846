"""Leasing batches: sizes, long polls, order, reuse, groups."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from app.main import create_app
from tests.api.support import (
    asgi_client,
    assert_error,
    events,
    fail_over_before_first,
    ids,
    nack,
    patch,
    replica_of,
    retired,
    retired_items,
    set_policy,
)
from tests.helpers import (
    ack,
    answered_before,
    lease,
    make_run,
    post,
    rollout,
    until_long_polling,
)


async def test_lease_exact_size_and_batch_shape(api):
    await make_run(api, "r1")
    await post(api, "r1", *(rollout(f"r{i}") for i in range(5)))
    before = datetime.now(UTC)
    resp = await lease(api, "r1", 3, trainer_id="t-1")
    assert resp.status_code == 200, resp.text
    batch = resp.json()
    assert set(batch) == {
        "batch_id",
        "policy_version",
        "lease_expires_at",
        "kl_coef",
        "rollouts",
    }
    assert isinstance(batch["batch_id"], str)
    assert batch["batch_id"]
    assert batch["policy_version"] == 0
    expires = datetime.fromisoformat(batch["lease_expires_at"].replace("Z", "+00:00"))
    # default lease_timeout_s is 300
    assert before + timedelta(seconds=290) < expires < before + timedelta(seconds=310)
    assert len(batch["rollouts"]) == 3
    assert len(set(ids(batch))) == 3
    # the rest
    resp = await lease(api, "r1", 2)
    assert resp.status_code == 200
    rest = resp.json()
    assert rest["batch_id"] != batch["batch_id"]
    assert sorted(ids(batch) + ids(rest)) == [f"r{i}" for i in range(5)]
    assert (await lease(api, "r1", 1)).status_code == 204


async def test_not_enough_is_204_unless_partial(api):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a"), rollout("b"))
    resp = await lease(api, "r1", 3)
    assert resp.status_code == 204
    assert resp.content == b""
    resp = await lease(api, "r1", 3, partial=False)
    assert resp.status_code == 204
    resp = await lease(api, "r1", 3, partial=True)
    assert resp.status_code == 200
    assert sorted(ids(resp.json())) == ["a", "b"]
    # partial never returns an empty batch
    assert (await lease(api, "r1", 3, partial=True)).status_code == 204


async def test_empty_run_is_204(api):
    await make_run(api, "r1")
    assert (await lease(api, "r1", 1)).status_code == 204
    assert (await lease(api, "r1", 1, partial=True, wait_s=0)).status_code == 204


# The app's long polls re-check only when woken (tests/conftest.py). Each test's long poll must
# answer before a second one, on a run that gets nothing and with a quarter of the wait, ends:
# it was woken by the ingest's pub/sub message, not answered by its last try at the deadline.
# The second one is cancelled then, but a cancellation that lands as one of its Redis commands
# completes can be lost (redis-py sends each under asyncio.wait_for, which on Python 3.11 then
# returns as if none had come), and the poll runs out its wait: a quarter keeps that short.
LONG_POLL_S = 20
IDLE_S = LONG_POLL_S / 4


async def test_long_poll_returns_when_rollouts_arrive(api, redis, prefix):
    await make_run(api, "r1")
    await make_run(api, "idle")
    waiting = asyncio.create_task(lease(api, "r1", 2, wait_s=LONG_POLL_S))
    await until_long_polling(redis, prefix, "r1")
    idle = asyncio.create_task(lease(api, "idle", 1, wait_s=IDLE_S))
    assert (await post(api, "r1", rollout("a"), rollout("b"))).json()["accepted"] == 2
    resp = await answered_before(waiting, idle)
    assert resp.status_code == 200, resp.text
    assert sorted(ids(resp.json())) == ["a", "b"]


async def test_long_poll_waits_for_the_whole_batch(api, redis, prefix):
    await make_run(api, "r1")
    await make_run(api, "idle")
    waiting = asyncio.create_task(lease(api, "r1", 2, wait_s=LONG_POLL_S))
    await until_long_polling(redis, prefix, "r1")
    idle = asyncio.create_task(lease(api, "idle", 1, wait_s=IDLE_S))
    await post(api, "r1", rollout("a"))
    await post(api, "r1", rollout("b"))
    resp = await answered_before(waiting, idle)
    assert resp.status_code == 200
    assert sorted(ids(resp.json())) == ["a", "b"]


async def test_long_poll_with_nothing_is_204_after_wait_s(api):
    await make_run(api, "r1")
    started = time.monotonic()
    resp = await lease(api, "r1", 1, wait_s=0.4)
    elapsed = time.monotonic() - started
    assert resp.status_code == 204
    assert 0.4 <= elapsed < 3.0


async def test_partial_long_poll_returns_what_it_has_at_the_deadline(api):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a"))
    resp = await lease(api, "r1", 4, wait_s=0.3, partial=True)
    assert resp.status_code == 200
    assert ids(resp.json()) == ["a"]


@pytest.mark.parametrize(
    "params",
    [
        {"size": 0},
        {"size": -1},
        {"size": "x"},
        {"wait_s": -1},
        {"wait_s": "nan"},
        {"policy_version": -1},
        {"partial": "maybe"},
    ],
)
async def test_invalid_lease_parameters_are_422(api, params):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a"))
    q = {"size": 1, **params}
    resp = await api.get("/v1/runs/r1/batch", params=q)
    assert_error(resp, 422, "ValidationFailed")
    assert (await lease(api, "r1", 1)).status_code == 200  # nothing was leased by it


async def test_missing_size_is_422(api):
    await make_run(api, "r1")
    assert_error(await api.get("/v1/runs/r1/batch"), 422, "ValidationFailed")


async def test_policy_version_above_current_is_422(api):
    await make_run(api, "r1")
    await set_policy(api, "r1", 2)
    await post(api, "r1", rollout("a", 2))
    detail = assert_error(await lease(api, "r1", 1, policy_version=3), 422, "ValidationFailed")
    assert "policy_version" in detail
    resp = await lease(api, "r1", 1, policy_version=2)
    assert resp.status_code == 200
    assert resp.json()["policy_version"] == 2


async def test_size_not_a_multiple_of_group_size_is_422(api):
    await make_run(api, "r1", group_size=2)
    await post(api, "r1", rollout("a", group="g"), rollout("b", group="g"))
    for size in (1, 3):
        detail = assert_error(await lease(api, "r1", size, partial=True), 422, "ValidationFailed")
        assert "group_size" in detail
    assert sorted(ids((await lease(api, "r1", 2)).json())) == ["a", "b"]


async def _mixed_versions(api, order: str) -> None:
    await make_run(api, "r1", max_staleness=2, order=order)
    await set_policy(api, "r1", 2)
    for rid, v in (("a", 0), ("b", 1), ("c", 0), ("d", 2), ("e", 1), ("f", 2)):
        assert (await post(api, "r1", rollout(rid, v))).json()["accepted"] == 1


async def _drain_one_by_one(api) -> list[str]:
    got = []
    while (resp := await lease(api, "r1", 1)).status_code == 200:
        got += ids(resp.json())
        assert len(got) <= 6
    return got


async def test_order_freshest_is_highest_version_then_oldest_arrival(api):
    await _mixed_versions(api, "freshest")
    assert sorted(ids((await lease(api, "r1", 3)).json())) == ["b", "d", "f"]
    assert await _drain_one_by_one(api) == ["e", "a", "c"]


async def test_order_freshest_one_by_one(api):
    await _mixed_versions(api, "freshest")
    assert await _drain_one_by_one(api) == ["d", "f", "b", "e", "a", "c"]


async def test_order_fifo_is_lowest_version_then_arrival(api):
    await _mixed_versions(api, "fifo")
    assert sorted(ids((await lease(api, "r1", 2)).json())) == ["a", "c"]
    assert await _drain_one_by_one(api) == ["b", "e", "d", "f"]


@pytest.mark.parametrize("order", ["fifo", "freshest"])
async def test_order_among_equal_versions_is_fewer_uses_then_arrival(api, order):
    """A rollout back from a use goes behind those of its version with fewer uses, whatever
    its arrival; one back from a nack (no use) keeps its place."""
    await make_run(api, "r1", max_reuse=3, order=order)
    await post(api, "r1", rollout("a"), rollout("b"), rollout("c"))
    first = (await lease(api, "r1", 1)).json()
    assert ids(first) == ["a"]
    assert (await ack(api, "r1", first["batch_id"])).status_code == 200
    second = (await lease(api, "r1", 1)).json()
    assert ids(second) == ["b"]
    assert (await nack(api, "r1", second["batch_id"])).json() == {"returned": 1}
    assert await _drain_one_by_one(api) == ["b", "c", "a"]


async def test_order_by_patch_applies_at_once(api):
    await _mixed_versions(api, "fifo")
    assert ids((await lease(api, "r1", 1)).json()) == ["a"]
    await patch(api, "r1", order="freshest")
    assert ids((await lease(api, "r1", 1)).json()) == ["d"]


async def test_nacked_rollout_keeps_its_place_in_fifo(api):
    await make_run(api, "r1", order="fifo")
    await post(api, "r1", rollout("a"), rollout("b"), rollout("c"))
    first = (await lease(api, "r1", 1)).json()
    assert ids(first) == ["a"]
    assert (await nack(api, "r1", first["batch_id"])).json() == {"returned": 1}
    assert await _drain_one_by_one(api) == ["a", "b", "c"]


async def test_order_random_returns_valid_disjoint_subsets(api):
    await make_run(api, "r1", order="random")
    all_ids = [f"r{i:02d}" for i in range(30)]
    await post(api, "r1", *(rollout(r) for r in all_ids))
    seen: list[str] = []
    for size in (5, 10, 15):
        resp = await lease(api, "r1", size)
        assert resp.status_code == 200, resp.text
        got = ids(resp.json())
        assert len(got) == size
        assert set(got) <= set(all_ids)
        seen += got
    assert Counter(seen) == Counter(all_ids)
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204


async def test_max_reuse_two_then_retires(api, redis, prefix):
    await make_run(api, "r1", max_reuse=2)
    await post(api, "r1", rollout("a", tokens=6))
    uses = []
    for _ in range(2):
        resp = await lease(api, "r1", 1)
        assert resp.status_code == 200
        [r] = resp.json()["rollouts"]
        uses.append(r["uses"])
        res = await ack(api, "r1", resp.json()["batch_id"])
        assert res.status_code == 200
    assert uses == [0, 1]
    assert res.json()["retired"] == 1
    assert (await lease(api, "r1", 1)).status_code == 204
    assert (await retired_items(redis, prefix, "r1")) == {"max_reuse": [["a", 0, 6, 2]]}


async def test_uses_and_lag_fields(api):
    await make_run(api, "r1", max_reuse=3, max_staleness=3)
    await post(api, "r1", rollout("a", 0))
    b1 = (await lease(api, "r1", 1)).json()
    assert [(r["uses"], r["lag"]) for r in b1["rollouts"]] == [(0, 0)]
    await ack(api, "r1", b1["batch_id"])
    await set_policy(api, "r1", 2)
    await post(api, "r1", rollout("b", 1))
    b2 = (await lease(api, "r1", 2)).json()
    assert b2["policy_version"] == 2
    assert {r["rollout_id"]: (r["uses"], r["lag"]) for r in b2["rollouts"]} == {
        "a": (1, 2),
        "b": (0, 1),
    }
    await ack(api, "r1", b2["batch_id"])
    # leasing at an explicit older version measures lag from it
    b3 = (await lease(api, "r1", 2, policy_version=1)).json()
    assert b3["policy_version"] == 1
    assert {r["rollout_id"]: (r["uses"], r["lag"]) for r in b3["rollouts"]} == {
        "a": (2, 1),
        "b": (1, 0),
    }


async def test_leased_rollouts_are_not_leased_again_until_returned(api):
    await make_run(api, "r1", max_reuse=5)
    await post(api, "r1", rollout("a"), rollout("b"))
    b1 = (await lease(api, "r1", 2)).json()
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204
    await ack(api, "r1", b1["batch_id"])
    b2 = (await lease(api, "r1", 2)).json()
    assert sorted(ids(b2)) == ["a", "b"]


async def test_groups_are_handed_out_whole_and_only_when_complete(api):
    await make_run(api, "r1", group_size=2, order="fifo")
    resp = await post(
        api,
        "r1",
        rollout("g1-a", group="g1"),
        rollout("g2-a", group="g2"),
        rollout("g3-a", group="g3"),
        rollout("g1-b", group="g1"),
        rollout("g3-b", group="g3"),
    )
    assert resp.json()["accepted"] == 5
    b1 = (await lease(api, "r1", 2)).json()
    assert sorted(ids(b1)) == ["g1-a", "g1-b"]
    assert {r["group_id"] for r in b1["rollouts"]} == {"g1"}
    # g3 is complete but g2 is not: a batch of 4 cannot be filled
    assert (await lease(api, "r1", 4)).status_code == 204
    b2 = (await lease(api, "r1", 4, partial=True)).json()
    assert sorted(ids(b2)) == ["g3-a", "g3-b"]
    # g2 alone is incomplete: never handed out
    assert (await lease(api, "r1", 2, partial=True)).status_code == 204
    await post(api, "r1", rollout("g2-b", group="g2"))
    b3 = (await lease(api, "r1", 2)).json()
    assert sorted(ids(b3)) == ["g2-a", "g2-b"]


async def test_a_batch_never_splits_a_group(api):
    await make_run(api, "r1", group_size=3, order="random")
    for g in range(6):
        await post(api, "r1", *(rollout(f"g{g}-{i}", group=f"g{g}") for i in range(3)))
    seen = []
    for size in (6, 3, 9):
        batch = (await lease(api, "r1", size)).json()
        groups = Counter(r["group_id"] for r in batch["rollouts"])
        assert len(batch["rollouts"]) == size
        assert all(n == 3 for n in groups.values()), groups
        seen += ids(batch)
    assert sorted(seen) == sorted(f"g{g}-{i}" for g in range(6) for i in range(3))


async def test_group_lag_is_per_rollout(api):
    await make_run(api, "r1", group_size=2, max_staleness=2)
    await post(api, "r1", rollout("a", 0, group="g"))
    await set_policy(api, "r1", 1)
    await post(api, "r1", rollout("b", 1, group="g"))
    batch = (await lease(api, "r1", 2)).json()
    assert {r["rollout_id"]: r["lag"] for r in batch["rollouts"]} == {"a": 1, "b": 0}


async def test_drop_zero_variance_groups(api, redis, prefix):
    await make_run(api, "r1", group_size=3, drop_zero_variance_groups=True)
    resp = await post(
        api,
        "r1",
        *(rollout(f"same-{i}", group="same", reward=0.5) for i in range(3)),
        *(rollout(f"diff-{i}", group="diff", reward=float(i == 2)) for i in range(3)),
    )
    assert resp.json() == {"accepted": 6, "duplicates": 0, "rejected": []}
    assert (await retired_items(redis, prefix, "r1")) == {
        "zero_variance": [[f"same-{i}", 0, 4, 0] for i in range(3)]
    }
    batch = (await lease(api, "r1", 3)).json()
    assert sorted(ids(batch)) == ["diff-0", "diff-1", "diff-2"]
    assert (await lease(api, "r1", 3, partial=True)).status_code == 204


async def test_zero_variance_groups_are_kept_by_default(api, redis, prefix):
    await make_run(api, "r1", group_size=2)
    await post(api, "r1", *(rollout(f"s{i}", group="s", reward=1.0) for i in range(2)))
    assert sorted(ids((await lease(api, "r1", 2)).json())) == ["s0", "s1"]
    assert (await retired(redis, prefix, "r1")) == {}


async def test_incomplete_group_retires_after_group_timeout(api, redis, prefix):
    await make_run(api, "r1", group_size=2)
    await post(api, "r1", rollout("late-a", group="late"))
    await post(api, "r1", rollout("done-a", group="done"), rollout("done-b", group="done"))
    created = time.monotonic()
    # The default timeout (600 s) keeps the incomplete group.
    assert ids((await lease(api, "r1", 2)).json()) == ["done-a", "done-b"]
    assert (await retired(redis, prefix, "r1")) == {}
    await post(api, "r1", rollout("new-a", group="new"), rollout("new-b", group="new"))
    await patch(api, "r1", group_timeout_s=0.2)
    # Let the shortened timeout pass (measured from after the first ingest), then a lease
    # call's clean-up retires the incomplete group.
    await asyncio.sleep(max(0.0, created + 0.3 - time.monotonic()))
    resp = await lease(api, "r1", 2, partial=True)
    assert sorted(ids(resp.json())) == ["new-a", "new-b"]
    assert (await retired_items(redis, prefix, "r1")) == {"incomplete_group": [["late-a", 0, 4, 0]]}
    assert (await lease(api, "r1", 2, partial=True)).status_code == 204


async def test_lease_event_records_the_batch(api, redis, prefix):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a", tokens=3))
    batch = (await lease(api, "r1", 1, trainer_id="trainer-7")).json()
    leased = [d for e, d in await events(redis, prefix, "r1") if e == "leased"]
    assert len(leased) == 1
    assert leased[0]["batch_id"] == batch["batch_id"]
    assert leased[0]["trainer_id"] == "trainer-7"
    assert leased[0]["items"] == [["a", 0, 3, 0, 0]]


async def test_version_at_the_largest_exact_integer(api):
    await make_run(api, "r1")
    top = 2**53 - 1
    assert await set_policy(api, "r1", top) == {"policy_version": top, "evicted": 0}
    await post(api, "r1", rollout("a", top))
    batch = (await lease(api, "r1", 1)).json()
    assert batch["policy_version"] == top
    assert [(r["policy_version"], r["lag"]) for r in batch["rollouts"]] == [(top, 0)]
    assert_error(
        await api.post("/v1/runs/r1/policy", json={"version": 2**53}), 422, "ValidationFailed"
    )


async def test_size_above_the_largest_batch_is_422(api, settings):
    await make_run(api, "r1")
    resp = await lease(api, "r1", settings.max_batch_size + 1)
    assert_error(resp, 422, "ValidationFailed")


async def test_lease_at_an_older_version_gets_no_rollouts_from_newer_policies(api):
    await make_run(api, "r1", max_staleness=5)
    await set_policy(api, "r1", 2)
    await post(api, "r1", rollout("v2", 2))
    resp = await lease(api, "r1", 1, policy_version=1)
    if resp.status_code == 200:
        assert [r["lag"] for r in resp.json()["rollouts"]] == [0]  # fails: lag is -1
    assert resp.status_code == 204


async def test_a_retried_lease_whose_batch_a_failover_lost_is_made_again(
    settings, redis, prefix, monkeypatch
):
    """A lease made on a master that a failover replaced before the lease's rollouts were read:
    the read reached the promoted replica (a client may carry a command over rather than fail
    it; redis-py 8.2 does), which has neither the batch nor the rollouts ingested since it last
    replicated. The lease is made again there, under the same batch id, rather than refused as
    expired (which the retried lease of a trainer would be, for good)."""
    app = create_app(settings)
    async with asgi_client(app) as api:
        await make_run(api, "r1")
        await post(api, "r1", *(rollout(f"old{i}") for i in range(2)))
        await set_policy(api, "r1", 1)
        replica = await replica_of(redis, prefix, "r1")
        await post(api, "r1", *(rollout(f"new{i}", 1) for i in range(2)))  # the freshest
        store = app.state.broker.store
        failovers = fail_over_before_first(
            monkeypatch, store, "blobs", redis, prefix, "r1", replica
        )
        resp = await lease(api, "r1", 2, batch_id="trainer-0-step-1")
        assert failovers == [["new0", "new1"]]
        assert resp.status_code == 200, resp.text
        assert resp.json()["batch_id"] == "trainer-0-step-1"
        assert sorted(ids(resp.json())) == ["old0", "old1"]
        assert (await ack(api, "r1", "trainer-0-step-1")).status_code == 200


async def test_a_retried_lease_with_its_batch_id_gets_the_same_batch(api):
    await make_run(api, "r1")
    await post(api, "r1", *[rollout(f"x{i}") for i in range(4)])
    first = await lease(api, "r1", 2, batch_id="trainer-0-step-1")
    again = await lease(api, "r1", 2, batch_id="trainer-0-step-1")
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json()
    assert first.json()["batch_id"] == "trainer-0-step-1"
    other = await lease(api, "r1", 2)
    assert set(ids(other.json())).isdisjoint(ids(first.json()))
    assert (await ack(api, "r1", "trainer-0-step-1")).status_code == 200
    settled = await lease(api, "r1", 2, batch_id="trainer-0-step-1")
    assert settled.status_code == 409
    assert settled.json()["error"] == "BatchSettled"
    bad = await lease(api, "r1", 2, batch_id="no spaces")
    assert bad.status_code == 422
