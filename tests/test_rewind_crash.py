"""A rewind in the middle of a running system: two API processes, generators taking work and
posting, two trainers leasing and acknowledging while the run is rewound through the other
process, the worker SIGKILLed just before the rewind and Redis (AOF, fsync always) just after
it, both started again. Every prompt ends trained exactly once beyond the uses the rewind gave
back, and the ledger holds its invariants and equals the live state."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import keys
from tests.helpers import answers_for, live_of_ledger
from tests.processes import KillableRedis
from tests.traffic import brokers

pytestmark = pytest.mark.slow

PREFIX = "rewind-crash"
RUN = "rewound-run"
N_PROMPTS = 40
REWIND_AT, REWIND_TO = 6, 3


class Calls:
    """Requests through either API process, resent through outages (every request below is
    safe to resend: the ids are the client's, and a rewind to a version the run is already at
    is the plain change, a no-op)."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [httpx.AsyncClient(base_url=u, timeout=30) for u in urls]
        self.turn = itertools.count()

    async def __call__(self, method: str, path: str, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + 90
        while True:
            client = self.clients[next(self.turn) % len(self.clients)]
            try:
                resp = await client.request(method, path, **kw)
                if resp.status_code not in (502, 503, 504):
                    return resp
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{method} {path} kept failing"
            await asyncio.sleep(0.05)

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()


async def test_a_rewind_racing_acks_and_work_through_kills_loses_and_doubles_nothing(
    database_url: str, tmp_path: Path
) -> None:
    redis_server = KillableRedis("redis", tmp_path, keys.run_key(PREFIX, RUN))
    await redis_server.start()
    apis, worker = brokers(redis_server.backend.env(), database_url, PREFIX, tmp_path)
    calls: Calls | None = None
    try:
        await asyncio.gather(*(a.start() for a in apis), worker.start())
        calls = Calls([a.url for a in apis])
        call = calls
        config = {
            "group_size": 2,
            "max_staleness": 2,
            "order": "fifo",
            "max_attempts": 100,
            "work_timeout_s": 5,
            "lease_timeout_s": 5,
        }
        resp = await call("POST", "/v1/runs", json={"run_id": RUN, "config": config})
        assert resp.status_code == 201, resp.text
        body = {"prompts": [{"prompt_id": f"p{i}"} for i in range(N_PROMPTS)]}
        assert (await call("POST", f"/v1/runs/{RUN}/prompts", json=body)).status_code == 202
        state = {
            "acks": 0,
            "rewound": False,
            "finished": False,
            "refused_acks": 0,
            "refused_leases": 0,
        }

        async def generator(g: int) -> None:
            for n in itertools.count():
                if state["finished"]:
                    return
                work = {"max_prompts": 2, "wait_s": 0.5, "lease_id": f"gen{g}-{n:06d}"}
                resp = await call("POST", f"/v1/runs/{RUN}/work", json=work)
                if resp.status_code == 204:
                    continue
                assert resp.status_code == 200, resp.text
                lease = resp.json()
                for p in lease["prompts"]:
                    rollouts = answers_for(p, lease["policy_version"])
                    out = await call(
                        "POST", f"/v1/runs/{RUN}/rollouts", json={"rollouts": rollouts}
                    )
                    assert out.status_code == 202, out.text

        async def trainer(t: int) -> None:
            for n in itertools.count():
                if state["finished"]:
                    return
                bid = f"train{t}-{n:06d}"
                params = {"size": 4, "wait_s": 0.5, "batch_id": bid, "partial": "true"}
                resp = await call("GET", f"/v1/runs/{RUN}/batch", params=params)
                if resp.status_code == 204:
                    continue
                if resp.status_code == 409:
                    # Its lease ended before its rollouts were read: the rewind (or an outage
                    # longer than the lease) came between the lease script and that read.
                    assert resp.json()["error"] == "LeaseExpired", resp.text
                    state["refused_leases"] += 1
                    continue
                assert resp.status_code == 200, resp.text
                ack = await call("POST", f"/v1/runs/{RUN}/batches/{bid}/ack", json={})
                if ack.status_code == 409:  # its lease ended with the rewind
                    assert ack.json()["error"] == "LeaseExpired", ack.text
                    state["refused_acks"] += 1
                    continue
                assert ack.status_code == 200, ack.text
                state["acks"] += 1

        async def controller() -> None:
            """The version follows the acks (a version per two batches); at REWIND_AT the
            trainer 'restores its checkpoint' of REWIND_TO around a worker and a Redis crash."""
            version = 0
            while not state["finished"]:
                if state["acks"] >= 2 * (version + 1):
                    version += 1
                    if version == REWIND_AT and not state["rewound"]:
                        await worker.kill()
                        resp = await call(
                            "POST",
                            f"/v1/runs/{RUN}/policy",
                            json={"version": REWIND_TO, "rewind": True},
                        )
                        assert resp.status_code == 200, resp.text
                        assert resp.json()["policy_version"] == REWIND_TO
                        await redis_server.kill_run_node()
                        await redis_server.restart_run_node()
                        await worker.start()
                        state["rewound"], state["acks"], version = True, 2 * REWIND_TO, REWIND_TO
                        continue
                    resp = await call("POST", f"/v1/runs/{RUN}/policy", json={"version": version})
                    assert resp.status_code == 200, resp.text
                await asyncio.sleep(0.02)

        async def finished() -> dict[str, Any]:
            deadline = time.monotonic() + 240
            while True:
                acc: dict[str, Any] = (await call("GET", f"/v1/runs/{RUN}/accounting")).json()
                if (
                    state["rewound"]
                    and acc["pending_events"] == 0
                    and acc["prompts"]["done"] == N_PROMPTS
                ):
                    state["finished"] = True
                    return acc
                assert time.monotonic() < deadline, (state, acc)
                await asyncio.sleep(0.2)

        actors = [generator(g) for g in range(3)] + [trainer(t) for t in range(2)] + [controller()]
        tasks = [asyncio.create_task(a) for a in actors]
        acc = await finished()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        # Whatever the last leases and posts changed, once drained.
        deadline = time.monotonic() + 60
        while acc["pending_events"] or acc["live"] != live_of_ledger(acc):
            assert time.monotonic() < deadline, acc
            await asyncio.sleep(0.2)
            acc = (await call("GET", f"/v1/runs/{RUN}/accounting")).json()
        audit = (await call("GET", "/v1/audit", params={"run_id": RUN})).json()
        ledger: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
            page = (await call("GET", f"/v1/runs/{RUN}/batches", params=params)).json()
            ledger += page["batches"]
            if not (cursor := page["next_cursor"]):
                break
    finally:
        if calls is not None:
            await calls.aclose()
        await asyncio.gather(*(a.stop() for a in apis), worker.stop(), return_exceptions=True)
        await redis_server.stop()

    p = acc["prompts"]
    assert (p["registered"], p["done"], p["queued"], p["in_flight"], p["failed"]) == (
        N_PROMPTS,
        N_PROMPTS,
        0,
        0,
        0,
    ), acc
    assert acc["dead_letters"] == 0, acc
    # The rewind undid real work, and every pass stands on exactly one use of its group (max
    # reuse 1): what the gradients counted beyond that is exactly what the rewind gave back.
    assert acc["samples_rewound"] > 0, acc
    assert acc["samples_consumed"] - acc["samples_rewound"] == 2 * N_PROMPTS, acc
    assert acc["rollouts_received"] == acc["buffered"] + acc["leased"] + sum(
        acc["retired"].values()
    ), acc
    # Undone batches stay acknowledged: samples_consumed still counts every gradient.
    assert acc["samples_consumed"] == sum(b["size"] for b in ledger if b["outcome"] == "acked")
    assert [e["action"] for e in audit["entries"]].count("run.rewind") == 1, audit
