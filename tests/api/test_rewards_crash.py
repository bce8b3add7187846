"""Crashes around reward leases: a reward worker SIGKILLed mid-lease and an API process killed
between a lease and its scores lose no rollout and score none twice. Every rollout is scored
exactly once (or retires `reward_timeout`), and none reaches a trainer without its own score."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.api.conftest import _start_server, _stop_server
from tests.api.support import events
from tests.api.test_work_crash import caught_up, worker

pytestmark = pytest.mark.slow


def reward_of(rid: str) -> float:
    """The score a verifier gives rollout ``rid``: its own, told apart from every other's."""
    return int(rid.rsplit("-", 1)[1]) / 8


def group_rollouts(n_groups: int) -> list[dict[str, Any]]:
    return [
        {
            "rollout_id": f"g{g}-{2 * g + i}",
            "group_id": f"g{g}",
            "policy_version": 0,
            "response_ids": [1, 2, 3],
            "reward": None,
        }
        for g in range(n_groups)
        for i in range(2)
    ]


REWARDER = textwrap.dedent(
    """
    import sys, time, httpx
    url, run = sys.argv[1], sys.argv[2]
    body = {"max_rollouts": 100, "lease_id": "doomed-lease"}
    lease = httpx.post(f"{url}/v1/runs/{run}/rewards/lease", json=body).json()
    first = [r["rollout_id"] for r in lease["rollouts"] if r["group_id"] == "g0"]
    scores = {rid: int(rid.rsplit("-", 1)[1]) / 8 for rid in first}
    resp = httpx.post(
        f"{url}/v1/runs/{run}/rewards", json={"rewards": scores, "lease_id": "doomed-lease"}
    )
    assert resp.status_code == 200, resp.text
    print("scored", flush=True)
    time.sleep(3600)
    """
)


async def train(api: httpx.AsyncClient, run: str, n: int) -> dict[str, float]:
    """Lease and acknowledge ``n`` rollouts as they come; their rewards as trained."""
    trained: dict[str, float] = {}
    while len(trained) < n:
        resp = await api.get(f"/v1/runs/{run}/batch", params={"size": 2, "wait_s": 30})
        assert resp.status_code == 200, resp.text
        batch = resp.json()
        for r in batch["rollouts"]:
            assert r["rollout_id"] not in trained
            trained[r["rollout_id"]] = r["reward"]
        ack = await api.post(f"/v1/runs/{run}/batches/{batch['batch_id']}/ack", json={})
        assert ack.status_code == 200, ack.text
    return trained


async def scored_once(redis: Any, prefix: str, run: str) -> Counter[str]:
    """How many times each rollout was scored, by the run's events (which no drain has
    trimmed)."""
    return Counter(
        item[0]
        for kind, body in await events(redis, prefix, run)
        if kind == "scored"
        for item in body["items"]
    )


async def test_a_sigkilled_reward_worker_loses_nothing(
    api_servers, redis_backend, database_url, prefix, tmp_path
):
    url = api_servers[0]
    posted = group_rollouts(3)
    async with httpx.AsyncClient(base_url=url, timeout=60) as api:
        config = {"group_size": 2, "reward_timeout_s": 1.0}
        resp = await api.post("/v1/runs", json={"run_id": "r", "config": config})
        assert resp.status_code == 201
        assert (await api.post("/v1/runs/r/rollouts", json={"rollouts": posted})).status_code == 202
        with worker(redis_backend, database_url, prefix, tmp_path / "worker.log"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", REWARDER, api_servers[1], "r", stdout=asyncio.subprocess.PIPE
            )
            try:
                assert proc.stdout is not None
                assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"scored"
            finally:
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
            # Its lease holds the rest until it runs out; the worker's sweep then gives them
            # back, which wakes this long poll.
            resp = await api.post(
                "/v1/runs/r/rewards/lease", json={"max_rollouts": 100, "wait_s": 30}
            )
            assert resp.status_code == 200, resp.text
            again = resp.json()
            back = sorted(r["rollout_id"] for r in again["rollouts"])
            assert back == sorted(r["rollout_id"] for r in posted[2:])
            scores = {rid: reward_of(rid) for rid in back}
            body = {"rewards": scores, "lease_id": again["lease_id"]}
            assert (await api.post("/v1/runs/r/rewards", json=body)).json()["scored"] == 4
            trained = await train(api, "r", len(posted))
            acc = await caught_up(api, "r")
    assert trained == {r["rollout_id"]: reward_of(r["rollout_id"]) for r in posted}
    # Each rollout scored once (the drain has applied and trimmed the events: the ledger counts
    # the scores), and the dead worker's lease ran out once for each of the four it held.
    assert acc["rewards"] == {"awaiting": 0, "leased": 0, "scored": 6, "timed_out": 4}
    assert acc["live"]["rewards"] == {"awaiting": 0, "leased": 0}
    assert acc["samples_consumed"] == acc["rollouts_received"] == 6


@pytest.mark.one_node
async def test_an_api_process_killed_between_lease_and_score_loses_nothing(
    redis, redis_backend, database_url, prefix, tmp_path
):
    servers = [
        await _start_server(redis_backend, prefix, database_url, tmp_path / f"api{i}.log")
        for i in range(2)
    ]
    clients = [httpx.AsyncClient(base_url=s.url, timeout=30) for s in servers]
    posted = group_rollouts(8)
    try:
        api = clients[1]
        config = {"group_size": 2}
        assert (
            await api.post("/v1/runs", json={"run_id": "r", "config": config})
        ).status_code == 201
        assert (await api.post("/v1/runs/r/rollouts", json={"rollouts": posted})).status_code == 202
        # A lease made through the first process, which dies before the scores are posted.
        body = {"max_rollouts": 8, "lease_id": "lease-before-kill"}
        leased = (await clients[0].post("/v1/runs/r/rewards/lease", json=body)).json()
        servers[0].proc.send_signal(signal.SIGKILL)
        await servers[0].proc.wait()
        # The worker asks again through the other process: the same lease, the same rollouts.
        again = (await api.post("/v1/runs/r/rewards/lease", json=body)).json()
        assert again == leased
        mine = [r["rollout_id"] for r in leased["rollouts"]]
        half = {rid: reward_of(rid) for rid in mine[:4]}
        scored = {"rewards": half, "lease_id": leased["lease_id"]}
        assert (await api.post("/v1/runs/r/rewards", json=scored)).json()["scored"] == 4
        # The answer was lost on the way back: the same post again is all duplicates.
        assert (await api.post("/v1/runs/r/rewards", json=scored)).json() == {
            "scored": 0,
            "duplicates": 4,
            "retired": [],
        }
        rest = {rid: reward_of(rid) for rid in mine[4:]}
        await api.post("/v1/runs/r/rewards", json={"rewards": rest, "lease_id": leased["lease_id"]})
        while True:
            more = await api.post("/v1/runs/r/rewards/lease", json={"max_rollouts": 100})
            if more.status_code == 204:
                break
            ids = [r["rollout_id"] for r in more.json()["rollouts"]]
            body = {"rewards": {rid: reward_of(rid) for rid in ids}}
            assert (await api.post("/v1/runs/r/rewards", json=body)).json()["scored"] == len(ids)
        trained = await train(api, "r", len(posted))
        assert trained == {r["rollout_id"]: reward_of(r["rollout_id"]) for r in posted}
        assert set((await scored_once(redis, prefix, "r")).values()) == {1}
    finally:
        for c in clients:
            await c.aclose()
        for s in servers:
            await _stop_server(s)
