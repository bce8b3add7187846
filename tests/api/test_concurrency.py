"""Concurrency: idempotent ingest under contention, and no rollout in two live leases across
API processes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.api.support import events, ids
from tests.helpers import answered_before, make_run, rollout, until_long_polling

N_DUPES = 50


def _summed(results: list[httpx.Response]) -> tuple[int, int, list[Any]]:
    for r in results:
        assert r.status_code == 202, r.text
    bodies = [r.json() for r in results]
    return (
        sum(b["accepted"] for b in bodies),
        sum(b["duplicates"] for b in bodies),
        [x for b in bodies for x in b["rejected"]],
    )


async def _assert_one_stored(client: httpx.AsyncClient, redis, prefix: str) -> None:
    resp = await client.get("/v1/runs/r1/batch", params={"size": 10, "partial": "true"})
    assert resp.status_code == 200, resp.text
    [only] = resp.json()["rollouts"]
    assert only["rollout_id"] == "same"
    assert 0 <= only["reward"] < N_DUPES
    accepted = [
        it for e, d in await events(redis, prefix, "r1") if e == "accepted" for it in d["items"]
    ]
    assert [it[0] for it in accepted] == ["same"]


async def test_concurrent_posts_of_one_rollout_id_in_process(api, redis, prefix):
    await make_run(api, "r1")
    results = await asyncio.gather(
        *(
            api.post("/v1/runs/r1/rollouts", json={"rollouts": [rollout("same", reward=float(i))]})
            for i in range(N_DUPES)
        )
    )
    assert _summed(list(results)) == (1, N_DUPES - 1, [])
    await _assert_one_stored(api, redis, prefix)


async def test_concurrent_leases_in_process_never_overlap(api):
    await make_run(api, "r1")
    all_ids = [f"r{i:03d}" for i in range(200)]
    await api.post("/v1/runs/r1/rollouts", json={"rollouts": [rollout(r) for r in all_ids]})
    results = await asyncio.gather(
        *(api.get("/v1/runs/r1/batch", params={"size": 7, "partial": "true"}) for _ in range(40))
    )
    got = [rid for r in results if r.status_code == 200 for rid in ids(r.json())]
    assert all(r.status_code in (200, 204) for r in results)
    assert Counter(got) == Counter(all_ids)


async def test_concurrent_acks_of_one_batch_count_once(api, redis, prefix):
    await make_run(api, "r1", max_reuse=3, kl_max=10, kl_flush=10)
    await api.post("/v1/runs/r1/rollouts", json={"rollouts": [rollout("a"), rollout("b")]})
    batch = (await api.get("/v1/runs/r1/batch", params={"size": 2})).json()
    url = f"/v1/runs/r1/batches/{batch['batch_id']}/ack"
    results = await asyncio.gather(
        *(api.post(url, json={"kl": {"a": 0.01 * i}}) for i in range(10))
    )
    assert {r.status_code for r in results} == {200}
    answers = [r.json() for r in results]
    assert all(a == answers[0] for a in answers)
    assert answers[0]["consumed"] == 2
    assert [e for e, _ in await events(redis, prefix, "r1")].count("acked") == 1
    again = (await api.get("/v1/runs/r1/batch", params={"size": 2})).json()
    assert {r["uses"] for r in again["rollouts"]} == {1}


async def test_concurrent_ack_and_nack_settle_a_batch_once(api, redis, prefix):
    await make_run(api, "r1", max_reuse=100)
    await api.post("/v1/runs/r1/rollouts", json={"rollouts": [rollout("a")]})
    uses = 0
    for _ in range(10):
        batch = (await api.get("/v1/runs/r1/batch", params={"size": 1})).json()
        assert batch["rollouts"][0]["uses"] == uses
        base = f"/v1/runs/r1/batches/{batch['batch_id']}"
        acked, nacked = await asyncio.gather(
            api.post(base + "/ack", json={}), api.post(base + "/nack")
        )
        codes = sorted([acked.status_code, nacked.status_code])
        assert codes == [200, 409], (acked.text, nacked.text)
        loser = nacked if acked.status_code == 200 else acked
        assert loser.json()["error"] == "BatchSettled"
        uses += acked.status_code == 200
    kinds = [e for e, _ in await events(redis, prefix, "r1")]
    assert kinds.count("acked") + kinds.count("nacked") == 10
    assert kinds.count("acked") == uses


@pytest.mark.slow
async def test_long_poll_on_one_process_wakes_on_ingest_through_another(api_servers, redis, prefix):
    # The processes re-check only when woken (tests/api/conftest.py): the long poll must answer
    # before one on a run that gets nothing, with half the wait, ends; so the other process's
    # pub/sub message woke it, not the last try at its deadline.
    a, b = api_servers
    async with httpx.AsyncClient(timeout=60) as c:
        for run in ("r1", "idle"):
            assert (await c.post(a + "/v1/runs", json={"run_id": run})).status_code == 201
        waiting = asyncio.create_task(
            c.get(a + "/v1/runs/r1/batch", params={"size": 3, "wait_s": 20})
        )
        await until_long_polling(redis, prefix, "r1")
        idle = asyncio.create_task(
            c.get(a + "/v1/runs/idle/batch", params={"size": 1, "wait_s": 10})
        )
        resp = await c.post(
            b + "/v1/runs/r1/rollouts", json={"rollouts": [rollout(f"x{i}") for i in range(3)]}
        )
        assert resp.json()["accepted"] == 3
        got = await answered_before(waiting, idle)
        assert got.status_code == 200, got.text
        assert sorted(ids(got.json())) == ["x0", "x1", "x2"]
        # Ends the idle poll the server still runs, so the processes stop without waiting it out.
        await c.post(b + "/v1/runs/idle/rollouts", json={"rollouts": [rollout("end")]})


@pytest.mark.slow
async def test_concurrent_posts_of_one_rollout_id_across_two_processes(api_servers, redis, prefix):
    a, b = api_servers
    async with httpx.AsyncClient(timeout=30) as c:
        created = await c.post(a + "/v1/runs", json={"run_id": "r1"})
        assert created.status_code == 201, created.text
        results = await asyncio.gather(
            *(
                c.post(
                    (a, b)[i % 2] + "/v1/runs/r1/rollouts",
                    json={"rollouts": [rollout("same", reward=float(i))]},
                )
                for i in range(N_DUPES)
            )
        )
        assert _summed(list(results)) == (1, N_DUPES - 1, [])
        per_server = [
            sum(r.json()["accepted"] + r.json()["duplicates"] for r in results[k::2])
            for k in (0, 1)
        ]
        assert per_server == [N_DUPES // 2, N_DUPES // 2]
        async with httpx.AsyncClient(base_url=b, timeout=30) as cb:
            await _assert_one_stored(cb, redis, prefix)


TOTAL = 2000
TRAINERS = 8
SIZES = [1, 7, 16, 33, 64, 5, 50, 100]
DEADLINE_S = 45.0


@pytest.mark.slow
async def test_trainers_on_two_processes_consume_everything_exactly_once(
    api_servers, redis, prefix
):
    urls = api_servers
    all_ids = {f"ro-{i:05d}" for i in range(TOTAL)}
    async with httpx.AsyncClient(timeout=30) as c:
        created = await c.post(
            urls[0] + "/v1/runs", json={"run_id": "r1", "config": {"max_reuse": 1}}
        )
        assert created.status_code == 201, created.text
        ordered = sorted(all_ids)
        chunks = [ordered[i : i + 250] for i in range(0, TOTAL, 250)]
        posted = await asyncio.gather(
            *(
                c.post(
                    urls[k % 2] + "/v1/runs/r1/rollouts",
                    json={"rollouts": [rollout(r, tokens=8) for r in chunk]},
                )
                for k, chunk in enumerate(chunks)
            )
        )
        assert _summed(list(posted)) == (TOTAL, 0, [])

    received: Counter[str] = Counter()
    holding: set[str] = set()  # leased to some trainer, not yet handed back by it
    overlaps: list[str] = []
    acked: list[str] = []
    nacked_batches = 0
    deadline = time.monotonic() + DEADLINE_S

    async def trainer(k: int) -> None:
        nonlocal nacked_batches
        url = urls[k % 2]
        size = SIZES[k]
        n = 0
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            while len(acked) < TOTAL and time.monotonic() < deadline:
                resp = await c.get(
                    "/v1/runs/r1/batch",
                    params={"size": size, "wait_s": 0.1, "partial": "true", "trainer_id": f"t{k}"},
                )
                if resp.status_code == 204:
                    continue
                assert resp.status_code == 200, resp.text
                batch = resp.json()
                got = ids(batch)
                assert 1 <= len(got) <= size
                for rid in got:
                    if rid in holding:
                        overlaps.append(rid)
                    holding.add(rid)
                    received[rid] += 1
                n += 1
                give_back = n % 5 == 0  # every fifth batch goes back unused
                if give_back:
                    # Released from the moment the nack is sent: let go of them first.
                    holding.difference_update(got)
                    r = await c.post(f"/v1/runs/r1/batches/{batch['batch_id']}/nack")
                    assert r.status_code == 200, r.text
                    assert r.json() == {"returned": len(got)}
                    nacked_batches += 1
                else:
                    r = await c.post(f"/v1/runs/r1/batches/{batch['batch_id']}/ack", json={})
                    assert r.status_code == 200, r.text
                    assert r.json()["consumed"] == len(got)
                    assert r.json()["retired"] == len(got)  # max_reuse=1
                    acked.extend(got)
                    # Held until the ack answered: no other trainer got them meanwhile.
                    holding.difference_update(got)

    await asyncio.gather(*(trainer(k) for k in range(TRAINERS)))

    assert overlaps == []
    assert len(acked) == TOTAL, f"consumed {len(acked)} of {TOTAL} before the deadline"
    assert Counter(acked) == Counter(all_ids)  # every rollout acked exactly once
    assert set(received) == all_ids
    assert nacked_batches > 0

    # The event stream orders every change: replay it and check that no rollout was leased
    # while a live lease held it.
    live: dict[str, str] = {}
    leases = 0
    for e, d in await events(redis, prefix, "r1"):
        if e == "leased":
            leases += 1
            for item in d["items"]:
                assert item[0] not in live, (
                    f"{item[0]} leased twice: {live[item[0]]}, {d['batch_id']}"
                )
                live[item[0]] = d["batch_id"]
        elif e in ("acked", "nacked", "expired"):
            for item in d["items"]:
                assert live.pop(item[0]) == d["batch_id"]
    assert live == {}
    assert leases >= TOTAL // max(SIZES)
    # max_reuse=1: each rollout was received once, plus once per nacked batch that held it.
    nacked_ids = Counter(
        item[0]
        for e, d in await events(redis, prefix, "r1")
        if e == "nacked"
        for item in d["items"]
    )
    assert received == Counter(all_ids) + nacked_ids
