"""Runs: create (idempotent), list (paged), get, patch config, close, delete."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Literal

import pytest

from app import keys
from app.broker.store import RedisStore
from tests.api.support import (
    DEFAULT_CONFIG,
    assert_error,
    events,
    ids,
    patch,
    retired,
    retired_items,
)
from tests.helpers import ack, lease, make_run, post, rollout
from workers.drain import DrainContext, drain_once


def _assert_created_at_is_now(text: str) -> None:
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    assert when.tzinfo is not None
    assert abs(datetime.now(UTC) - when) < timedelta(minutes=5)


async def test_create_returns_201_and_the_run_with_spec_defaults(api):
    resp = await api.post("/v1/runs", json={"run_id": "r1"})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert set(body) == {"run_id", "config", "policy_version", "status", "created_at"}
    assert body["run_id"] == "r1"
    assert body["config"] == DEFAULT_CONFIG
    assert body["policy_version"] == 0
    assert body["status"] == "open"
    _assert_created_at_is_now(body["created_at"])


async def test_create_with_a_partial_config_fills_in_defaults(api):
    resp = await api.post(
        "/v1/runs", json={"run_id": "r1", "config": {"max_reuse": 4, "order": "fifo"}}
    )
    assert resp.status_code == 201, resp.text
    assert resp.json()["config"] == {**DEFAULT_CONFIG, "max_reuse": 4, "order": "fifo"}


async def test_same_config_again_is_200_and_changes_nothing(api):
    first = await api.post("/v1/runs", json={"run_id": "r1", "config": {"max_reuse": 2}})
    assert first.status_code == 201, first.text
    again = await api.post("/v1/runs", json={"run_id": "r1", "config": {"max_reuse": 2}})
    assert again.status_code == 200, again.text
    assert again.json() == first.json()


async def test_omitted_config_equals_explicit_defaults(api):
    first = await api.post("/v1/runs", json={"run_id": "r1"})
    assert first.status_code == 201
    for config in ({}, {"max_reuse": 1}, DEFAULT_CONFIG):
        again = await api.post("/v1/runs", json={"run_id": "r1", "config": config})
        assert again.status_code == 200, (config, again.text)
        assert again.json() == first.json()


async def test_different_config_is_409_run_conflict(api):
    await make_run(api, "r1", max_reuse=2)
    resp = await api.post("/v1/runs", json={"run_id": "r1", "config": {"max_reuse": 3}})
    assert_error(resp, 409, "RunConflict")
    resp = await api.post("/v1/runs", json={"run_id": "r1"})  # defaults differ too
    assert_error(resp, 409, "RunConflict")
    got = await api.get("/v1/runs/r1")
    assert got.json()["config"]["max_reuse"] == 2


async def test_run_id_is_generated_when_absent(api):
    a = await api.post("/v1/runs", json={})
    b = await api.post("/v1/runs", content=b"", headers={"content-type": "application/json"})
    assert a.status_code == 201, a.text
    assert b.status_code == 201, b.text
    ra, rb = a.json()["run_id"], b.json()["run_id"]
    assert ra != rb
    for rid in (ra, rb):
        assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", rid)
        got = await api.get(f"/v1/runs/{rid}")
        assert got.status_code == 200
        assert got.json()["run_id"] == rid
        assert got.json()["config"] == DEFAULT_CONFIG


@pytest.mark.parametrize(
    "body",
    [
        {"run_id": "has space"},
        {"run_id": ""},
        {"run_id": "x" * 129},
        {"run_id": 5},
        {"run_id": "r1", "config": {"max_reuse": 0}},
        {"run_id": "r1", "config": {"nope": 1}},
        {"run_id": "r1", "extra": 1},
    ],
)
async def test_create_with_an_invalid_body_is_422(api, body):
    resp = await api.post("/v1/runs", json=body)
    assert_error(resp, 422, "ValidationFailed")
    assert (await api.get("/v1/runs")).json() == {"runs": [], "next_cursor": None}


async def test_list_runs_lists_exactly_the_runs_created(api):
    created = {}
    for rid, cfg in (("a", {}), ("b", {"max_reuse": 3}), ("c", {"group_size": 2})):
        created[rid] = await make_run(api, rid, **cfg)
    resp = await api.get("/v1/runs")
    assert resp.status_code == 200
    assert resp.json()["next_cursor"] is None
    listed = {r["run_id"]: r for r in resp.json()["runs"]}
    assert listed == created


async def _pages(api, **params) -> list[list[str]]:
    """Every page of the listing, following next_cursor."""
    pages, cursor = [], None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        resp = await api.get("/v1/runs", params=query)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert set(body) == {"runs", "next_cursor"}
        pages.append([r["run_id"] for r in body["runs"]])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages


def _newest_first(runs: list[dict]) -> list[str]:
    def when(r: dict) -> tuple[datetime, str]:
        return datetime.fromisoformat(r["created_at"].replace("Z", "+00:00")), r["run_id"]

    return [r["run_id"] for r in sorted(runs, key=when, reverse=True)]


async def test_the_listing_pages_newest_first_and_filters_by_status(api):
    runs = [await make_run(api, f"run-{i:02d}") for i in range(11)]
    for closed in ("run-01", "run-04", "run-05", "run-09"):
        assert (await api.post(f"/v1/runs/{closed}/close")).status_code == 200
    every = _newest_first(runs)

    pages = await _pages(api, limit=3)
    assert [len(p) for p in pages[:3]] == [3, 3, 3]
    assert [rid for page in pages for rid in page] == every
    closed = [rid for rid in every if rid in {"run-01", "run-04", "run-05", "run-09"}]
    got = await _pages(api, status="closed", limit=2)
    assert [rid for page in got for rid in page] == closed
    got = await _pages(api, status="open", limit=2)
    assert [rid for page in got for rid in page] == [r for r in every if r not in closed]
    one = (await api.get("/v1/runs", params={"status": "open", "limit": 1000})).json()
    assert [r["run_id"] for r in one["runs"]] == [r for r in every if r not in closed]
    assert one["next_cursor"] is None


async def test_runs_created_in_the_same_millisecond_page_exactly_once(api, monkeypatch):
    monkeypatch.setattr("app.broker.store.time.time", lambda: 1_700_000_000.0)
    for rid in ("b", "a.1", "c", "a", "B", "a-2"):
        await make_run(api, rid)
    monkeypatch.undo()
    for limit in (1, 2, 4):
        pages = await _pages(api, limit=limit)
        assert [rid for page in pages for rid in page] == sorted(
            ["b", "a.1", "c", "a", "B", "a-2"], key=str.encode, reverse=True
        )


async def test_a_page_short_at_its_bound_names_only_runs_it_may_show(api, store, monkeypatch):
    """A page reads the states of PAGE_SCAN_SLACK runs beyond its own at most; with a view of
    some runs, those it may not show are neither read nor counted, and its cursor is always one
    of those it may show."""
    monkeypatch.setattr("app.broker.run_index.PAGE_SCAN_SLACK", 2)
    order = [f"{'mine' if i % 3 == 0 else 'other'}-{i:02d}" for i in range(18)]
    for rid in order:
        await make_run(api, rid)
    for rid in order[-6:]:
        assert (await api.post(f"/v1/runs/{rid}/close")).status_code == 200
    visible = lambda rid: rid.startswith("mine-")  # noqa: E731
    everything = [r for r in reversed(order) if visible(r)]

    async def walk(status: Literal["open", "closed"] | None) -> list[str]:
        seen, cursor = [], None
        while True:
            page = await store.list_runs(status, 1, cursor, visible)
            seen += [s.run_id for s in page.runs]
            cursor = page.next_cursor
            if cursor is None:
                return seen
            assert visible(cursor.partition(":")[2]), cursor

    assert await walk("open") == everything[2:]  # the closed ones are the newest
    assert await walk(None) == everything
    # Closed: its two runs are the newest of the caller's; after them, one page reads the
    # states of 1 + 2 open runs of its own, finds none closed, and stops short at the third.
    first = await store.list_runs("closed", 1, None, visible)
    assert [s.run_id for s in first.runs] == everything[:1]
    second = await store.list_runs("closed", 1, first.next_cursor, visible)
    assert [s.run_id for s in second.runs] == everything[1:2]
    short = await store.list_runs("closed", 1, second.next_cursor, visible)
    assert short.runs == [] and short.next_cursor is not None
    assert short.next_cursor.partition(":")[2] == everything[4]


@pytest.mark.parametrize(
    "query",
    [
        {"limit": 0},
        {"limit": 1001},
        {"limit": "x"},
        {"status": "deleted"},
        {"cursor": "nope"},
        {"cursor": "12:"},
        {"cursor": "nan:r"},
        {"cursor": "1e3:r"},
    ],
)
async def test_a_bad_listing_query_is_422(api, query):
    assert_error(await api.get("/v1/runs", params=query), 422, "ValidationFailed")


async def test_get_run_and_unknown_run_404(api):
    run = await make_run(api, "r1", max_staleness=3)
    got = await api.get("/v1/runs/r1")
    assert got.status_code == 200
    assert got.json() == run
    assert_error(await api.get("/v1/runs/nope"), 404, "RunNotFound")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/runs/nope", None),
        ("PATCH", "/v1/runs/nope/config", {"max_reuse": 2}),
        ("POST", "/v1/runs/nope/close", None),
        ("POST", "/v1/runs/nope/policy", {"version": 1}),
        ("POST", "/v1/runs/nope/rollouts", {"rollouts": [rollout("a")]}),
        ("GET", "/v1/runs/nope/batch?size=1", None),
        ("POST", "/v1/runs/nope/batches/abcdefgh/ack", {}),
        ("POST", "/v1/runs/nope/batches/abcdefgh/nack", None),
    ],
)
async def test_every_run_endpoint_answers_404_for_an_unknown_run(api, method, path, body):
    resp = await api.request(method, path, json=body)
    assert_error(resp, 404, "RunNotFound")


async def test_patch_config_is_partial_and_persists(api):
    await make_run(api, "r1", max_reuse=2, kl_max=0.5)
    body = await patch(api, "r1", max_staleness=4, order="fifo")
    expected = {
        **DEFAULT_CONFIG,
        "max_reuse": 2,
        "kl_max": 0.5,
        "max_staleness": 4,
        "order": "fifo",
    }
    assert body["config"] == expected
    assert body["run_id"] == "r1"
    assert body["status"] == "open"
    assert (await api.get("/v1/runs/r1")).json()["config"] == expected
    # The changed config is now the run's: re-creating with the old one conflicts.
    resp = await api.post(
        "/v1/runs", json={"run_id": "r1", "config": {"max_reuse": 2, "kl_max": 0.5}}
    )
    assert_error(resp, 409, "RunConflict")
    resp = await api.post("/v1/runs", json={"run_id": "r1", "config": expected})
    assert resp.status_code == 200


async def test_patch_lowering_max_reuse_applies_at_once(api, redis, prefix):
    await make_run(api, "r1", max_reuse=2)
    await post(api, "r1", rollout("a"))
    batch = (await lease(api, "r1", 1)).json()
    assert (await ack(api, "r1", batch["batch_id"])).json()["retired"] == 0
    # With max_reuse=2 "a" (uses=1) would be eligible again; lowering to 1 makes it not.
    await patch(api, "r1", max_reuse=1)
    resp = await lease(api, "r1", 1)
    assert resp.status_code == 204
    assert (await retired(redis, prefix, "r1")) == {"max_reuse": ["a"]}


async def test_patch_raising_max_reuse_applies_to_a_live_lease(api, redis, prefix):
    await make_run(api, "r1", max_reuse=1)
    await post(api, "r1", rollout("a"))
    batch = (await lease(api, "r1", 1)).json()
    await patch(api, "r1", max_reuse=3)
    res = (await ack(api, "r1", batch["batch_id"])).json()
    assert res["consumed"] == 1
    assert res["retired"] == 0
    again = await lease(api, "r1", 1)
    assert again.status_code == 200
    assert [(r["rollout_id"], r["uses"]) for r in again.json()["rollouts"]] == [("a", 1)]
    assert (await retired(redis, prefix, "r1")) == {}


@pytest.mark.parametrize(
    "body",
    [
        {"max_reuse": 0},
        {"max_staleness": -1},
        {"max_staleness": "x"},
        {"order": "newest"},
        {"kl_estimator": "k4"},
        {"clip_epsilon": 1.0},
        {"kl_max": -0.1},
        {"lease_timeout_s": 0},
        {"group_size": 0},
        {"capacity_rollouts": 0},
        {"unknown_field": 1},
    ],
)
async def test_invalid_patch_is_422_and_changes_nothing(api, body):
    run = await make_run(api, "r1", max_reuse=2)
    resp = await api.patch("/v1/runs/r1/config", json=body)
    assert_error(resp, 422, "ValidationFailed")
    assert (await api.get("/v1/runs/r1")).json() == run


async def test_patch_with_invalid_json_is_422(api):
    run = await make_run(api, "r1")
    resp = await api.patch(
        "/v1/runs/r1/config", content=b"{max_reuse: 2", headers={"content-type": "application/json"}
    )
    assert_error(resp, 422, "ValidationFailed")
    assert (await api.get("/v1/runs/r1")).json() == run


async def test_close_retires_buffered_rollouts_and_rejects_ingest(api, redis, prefix):
    await make_run(api, "r1", group_size=1)
    resp = await post(api, "r1", rollout("a", tokens=3), rollout("b", tokens=5))
    assert resp.json()["accepted"] == 2
    resp = await api.post("/v1/runs/r1/close")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "closed"
    assert body["run_id"] == "r1"
    assert (await api.get("/v1/runs/r1")).json()["status"] == "closed"

    items = await retired_items(redis, prefix, "r1")
    assert sorted(items) == ["run_closed"]
    # [rollout_id, policy_version, tokens, uses]: nothing was used, so the tokens are wasted.
    assert sorted(items["run_closed"]) == [["a", 0, 3, 0], ["b", 0, 5, 0]]

    resp = await post(api, "r1", rollout("c"), rollout("a"))
    assert resp.status_code == 202, resp.text
    assert resp.json() == {
        "accepted": 0,
        "duplicates": 1,
        "rejected": [{"rollout_id": "c", "reason": "run_closed"}],
    }
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204
    rejected = [d for e, d in await events(redis, prefix, "r1") if e == "rejected"]
    assert [item[:2] for d in rejected for item in d["items"]] == [["c", "run_closed"]]


async def test_close_is_idempotent_and_leased_rollouts_retire_when_they_return(api, redis, prefix):
    await make_run(api, "r1", max_reuse=3)
    await post(api, "r1", rollout("a"), rollout("b"))
    batch = (await lease(api, "r1", 1)).json()
    assert ids(batch) == ["a"]
    assert (await api.post("/v1/runs/r1/close")).status_code == 200
    again = await api.post("/v1/runs/r1/close")
    assert again.status_code == 200
    assert again.json()["status"] == "closed"
    assert (await retired(redis, prefix, "r1")) == {"run_closed": ["b"]}

    res = await ack(api, "r1", batch["batch_id"])
    assert res.status_code == 200, res.text
    assert res.json()["consumed"] == 1
    assert res.json()["retired"] == 1
    assert (await retired(redis, prefix, "r1")) == {"run_closed": ["a", "b"]}
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204


async def test_closed_run_keeps_its_config_and_version(api):
    await make_run(api, "r1", max_reuse=2)
    await api.post("/v1/runs/r1/policy", json={"version": 3})
    closed = (await api.post("/v1/runs/r1/close")).json()
    assert closed["config"] == {**DEFAULT_CONFIG, "max_reuse": 2}
    assert closed["policy_version"] == 3


# -- DELETE ----------------------------------------------------------------------------------
@pytest.fixture
def drain(redis, prefix, sessionmaker):
    return DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain")


async def _keys_of(redis, prefix: str, run_id: str) -> dict[str, int]:
    """Every key of the run, with its time to live in ms (-1: none)."""
    names = [k async for k in redis.scan_iter(match=f"{keys.run_base(prefix, run_id)}*")]
    return {k.decode(): await redis.pttl(k) for k in names}


async def test_delete_needs_a_closed_run_whose_accounting_has_caught_up(api, drain, redis, prefix):
    assert_error(await api.delete("/v1/runs/nope"), 404, "RunNotFound")
    await make_run(api, "r1", lease_timeout_s=60)
    await post(api, "r1", rollout("a"), rollout("b"))
    assert_error(await api.delete("/v1/runs/r1"), 409, "RunOpen")
    batch = (await lease(api, "r1", 1)).json()
    await api.post("/v1/runs/r1/close")
    resp = await api.delete("/v1/runs/r1")
    assert "buffered or leased" in assert_error(resp, 409, "RunBusy")
    assert resp.headers["retry-after"] == "1"
    assert (await ack(api, "r1", batch["batch_id"])).status_code == 200
    detail = assert_error(await api.delete("/v1/runs/r1"), 409, "RunBusy")
    assert "accounting" in detail  # the ack's events are not applied yet
    assert (await api.get("/v1/runs/r1")).status_code == 200  # nothing was deleted

    await drain_once(drain)
    accounting = (await api.get("/v1/runs/r1/accounting")).json()
    resp = await api.delete("/v1/runs/r1")
    assert resp.status_code == 204, resp.text
    assert resp.content == b""
    assert_error(await api.get("/v1/runs/r1"), 404, "RunNotFound")
    assert (await api.get("/v1/runs")).json() == {"runs": [], "next_cursor": None}
    after = (await api.get("/v1/runs/r1/accounting")).json()  # still readable
    live = ("as_of", "live")  # the live side (Redis) is what went
    assert {k: v for k, v in after.items() if k not in live} == {
        k: v for k, v in accounting.items() if k not in live
    }
    assert (await api.delete("/v1/runs/r1")).status_code == 204  # deleting again: the same
    # The id stays with its accounting; the run is gone for every other call.
    assert "deleted" in assert_error(await api.post("/v1/runs", json={"run_id": "r1"}), 409,
                                     "RunConflict")  # fmt: skip
    assert_error(await post(api, "r1", rollout("c")), 404, "RunNotFound")
    assert_error(await api.post("/v1/runs/r1/close"), 404, "RunNotFound")


async def test_delete_removes_every_key_of_the_run_in_bounded_steps(
    api, drain, redis, prefix, monkeypatch
):
    monkeypatch.setattr("app.broker.store.SWEEP_LIMIT", 8)  # so that it takes several steps
    await make_run(api, "r1", group_size=2)
    prompts = [{"prompt_id": f"p{i}", "prompt_ids": [1, 2]} for i in range(20)]
    resp = await api.post("/v1/runs/r1/prompts", json={"prompts": prompts, "epochs": 2})
    assert resp.json() == {"accepted": 20, "duplicates": 0}, resp.text
    work = (await api.post("/v1/runs/r1/work", json={"max_prompts": 1})).json()
    gid = work["prompts"][0]["group_id"]
    await post(api, "r1", rollout("a", group=gid), rollout("b", group=gid))
    batch = (await lease(api, "r1", 2)).json()
    assert (await ack(api, "r1", batch["batch_id"])).status_code == 200
    await post(api, "r1", rollout("c", group="solo"))
    # A prompt given back with a partial rollout: kept with its pass until the run closes.
    more = (await api.post("/v1/runs/r1/work", json={"max_prompts": 1})).json()
    given = {"rollout_id": "part", "group_id": more["prompts"][0]["group_id"]}
    given |= {"policy_version": 0, "response_ids": [1, 2]}
    resp = await api.post(f"/v1/runs/r1/work/{more['lease_id']}/return", json={"partials": [given]})
    assert resp.json() == {"returned": 1}
    assert len([k for k in await _keys_of(redis, prefix, "r1") if ":pt:" in k or ":pm:" in k]) == 2
    await api.post("/v1/runs/r1/close")  # which cancels its queued passes, dropping the partial
    await drain_once(drain)
    before = await _keys_of(redis, prefix, "r1")
    assert len([k for k in before if ":pp:" in k]) == 40
    assert not [k for k in before if ":pt:" in k or ":pm:" in k]

    steps = []
    real = RedisStore._call

    async def counted(self, name, run_id, *args):
        steps.append(name)
        return await real(self, name, run_id, *args)

    monkeypatch.setattr(RedisStore, "_call", counted)
    resp = await api.delete("/v1/runs/r1")
    assert resp.status_code == 204, resp.text
    assert steps.count("delete_run") > 2
    left = await _keys_of(redis, prefix, "r1")
    tombstone = keys.run_key(prefix, "r1")
    # What stays: the tombstone, and the batch and work-lease records, which expire by themselves.
    assert {k for k, ttl in left.items() if ttl < 0} == {tombstone}
    assert all(":b:" in k or ":w:" in k for k in left if k != tombstone)
    assert set(await redis.hgetall(tombstone)) == {b"id", b"st", b"created", b"deleted"}
    assert await redis.hget(tombstone, "st") == b"deleted"
    assert not await redis.zscore(keys.runs_key(prefix), "r1")
    assert not await redis.zscore(keys.active_key(prefix), "r1")
