"""Consumers across processes and crashes (SPEC "Consumers"): readers of one consumer spread
over two API processes never hold one item in two live leases, and a reader SIGKILLed with a
lease, then the API process that served it, lose nothing: the lease runs out, its items come
back through the other process, and the ledger's figures end exact."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.api.conftest import _start_server, _stop_server
from tests.api.test_work_crash import caught_up, worker

pytestmark = pytest.mark.slow


def rollouts(start: int, n: int) -> list[dict[str, Any]]:
    return [
        {"rollout_id": f"x{i}", "policy_version": 0, "response_ids": [1, 2, 3], "reward": 1.0}
        for i in range(start, start + n)
    ]


async def read_until(api: httpx.AsyncClient, name: str, seen: Counter[str], total: int) -> int:
    """Lease, record and ack the consumer's items until ``total`` were seen by all readers;
    how many batches this reader acked."""
    batches = 0
    deadline = time.monotonic() + 60
    while sum(seen.values()) < total:
        assert time.monotonic() < deadline, f"{sum(seen.values())} of {total} items seen"
        resp = await api.get(
            f"/v1/runs/r/consumers/{name}/batch", params={"size": 3, "wait_s": 0.5}
        )
        if resp.status_code == 204:
            continue
        assert resp.status_code == 200, resp.text
        body = resp.json()
        seen.update(r["rollout_id"] for r in body["rollouts"])
        ack = await api.post(f"/v1/runs/r/consumers/{name}/batches/{body['batch_id']}/ack")
        assert ack.json() == {"acked": len(body["rollouts"])}
        batches += 1
    return batches


async def test_readers_on_two_processes_never_share_an_item(api_servers):
    clients = [httpx.AsyncClient(base_url=url, timeout=60) for url in api_servers]
    a, b = clients
    try:
        assert (await a.post("/v1/runs", json={"run_id": "r"})).status_code == 201
        assert await a.post("/v1/runs/r/consumers", json={"name": "rm", "source": "received"})
        seen: Counter[str] = Counter()
        total = 120

        async def generate() -> None:
            for start in range(0, total, 10):
                api = clients[start // 10 % 2]
                resp = await api.post("/v1/runs/r/rollouts", json={"rollouts": rollouts(start, 10)})
                assert resp.status_code == 202, resp.text

        readers = [read_until(clients[i % 2], "rm", seen, total) for i in range(6)]
        done = await asyncio.gather(generate(), *readers)
        assert sum(done[1:]) >= total // 3  # every reader took part in a shared stream
        assert seen == Counter(f"x{i}" for i in range(total))  # each once, none lost
        view = (await b.get("/v1/runs/r/consumers/rm")).json()
        assert (view["delivered"], view["acked"], view["pending"]) == (total, total, 0)
    finally:
        for c in clients:
            await c.aclose()


READER = textwrap.dedent(
    """
    import sys, time, httpx
    url = sys.argv[1]
    resp = httpx.get(f"{url}/v1/runs/r/consumers/rm/batch", params={"size": 5})
    assert resp.status_code == 200, resp.text
    print(",".join(r["rollout_id"] for r in resp.json()["rollouts"]), flush=True)
    time.sleep(3600)
    """
)


@pytest.mark.one_node
async def test_a_killed_reader_and_api_process_lose_no_item(
    redis_backend, database_url, prefix, tmp_path
):
    servers = [
        await _start_server(redis_backend, prefix, database_url, tmp_path / f"api{i}.log")
        for i in range(2)
    ]
    api = httpx.AsyncClient(base_url=servers[1].url, timeout=60)
    try:
        config = {"lease_timeout_s": 1.0}
        assert (await api.post("/v1/runs", json={"run_id": "r", "config": config})).is_success
        body = {"name": "rm", "source": "received"}
        assert (await api.post("/v1/runs/r/consumers", json=body)).status_code == 201
        assert (
            await api.post("/v1/runs/r/rollouts", json={"rollouts": rollouts(0, 12)})
        ).is_success
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", READER, servers[0].url, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            held = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        servers[0].proc.send_signal(signal.SIGKILL)  # the process that served the lease
        await servers[0].proc.wait()
        assert len(held.split(",")) == 5
        with worker(redis_backend, database_url, prefix, tmp_path / "worker.log"):
            seen: Counter[str] = Counter()
            await read_until(api, "rm", seen, 12)  # the held five come back at expiry
            assert seen == Counter(f"x{i}" for i in range(12))
            acc = await caught_up(api, "r")
            assert acc["consumers"] == {
                "rm": {"delivered": 12, "acked": 12, "pending": 0, "dropped": 0}
            }
            # Deleting the run drops what its consumer still holds, counted before it goes.
            more = {"rollouts": rollouts(12, 3)}
            assert (await api.post("/v1/runs/r/rollouts", json=more)).is_success
            assert (await api.post("/v1/runs/r/close")).is_success
            deadline = time.monotonic() + 60
            while (resp := await api.delete("/v1/runs/r")).status_code == 409:
                assert resp.json()["error"] == "RunBusy", resp.text
                assert time.monotonic() < deadline, resp.text
                await asyncio.sleep(0.1)
            assert resp.status_code == 204, resp.text
            acc = (await api.get("/v1/runs/r/accounting")).json()
        assert acc["consumers"] == {
            "rm": {"delivered": 15, "acked": 12, "pending": 0, "dropped": 3}
        }
    finally:
        await api.aclose()
        for s in servers:
            await _stop_server(s)
