"""Crashes around partial rollouts: a generator SIGKILLed after giving prompts back with
partials, the API process that took the return SIGKILLed before the next hand-out, Redis
SIGKILLed and started again from its AOF, and a generator SIGKILLed holding the partials it
was handed (its lease expires). No prompt is lost, each partial comes back exactly as given,
neither lost nor doubled, the continued rollouts are trained, the prompt invariant holds and
the ledger equals the live state. One set of processes for the whole story."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import keys
from tests.helpers import live_of_ledger
from tests.processes import KillableRedis
from tests.traffic import brokers

pytestmark = pytest.mark.slow

PREFIX = "partials-crash"
RUN = "pc"

# Generator A: takes two prompts, gives both back with two partials each, then hangs.
GIVE_BACK = textwrap.dedent(
    """
    import json, sys, time, httpx
    url, run = sys.argv[1], sys.argv[2]
    lease = httpx.post(f"{url}/v1/runs/{run}/work", json={"max_prompts": 2}, timeout=30).json()
    partials = []
    for j, p in enumerate(lease["prompts"]):
        for k in range(2):
            n = 3 + k
            partials.append({
                "rollout_id": f"{p['prompt_id']}-{k}", "group_id": p["group_id"],
                "policy_version": 0, "response_ids": [100 * j + 10 * k + i for i in range(n)],
                "logprobs": [-0.125 * (i + 1) for i in range(n)],
            })
    resp = httpx.post(f"{url}/v1/runs/{run}/work/{lease['lease_id']}/return",
                      json={"partials": partials}, timeout=30)
    assert resp.status_code == 200, resp.text
    print(json.dumps(partials), flush=True)
    time.sleep(3600)
    """
)

# Generator C: takes two prompts (those given back), shows their partials, then hangs.
TAKE = textwrap.dedent(
    """
    import json, sys, time, httpx
    url, run = sys.argv[1], sys.argv[2]
    body = {"max_prompts": 2, "wait_s": 20}
    lease = httpx.post(f"{url}/v1/runs/{run}/work", json=body, timeout=60).json()
    print(json.dumps(lease["prompts"]), flush=True)
    time.sleep(3600)
    """
)


async def run_until_killed(script: str, url: str) -> Any:
    """Run a generator script until it prints its one line, then SIGKILL it; its line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, url, RUN, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    return json.loads(line)


class Calls:
    """HTTP calls through whichever API process answers, retried while one restarts or Redis
    comes back (each call here is safe to repeat)."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [httpx.AsyncClient(base_url=u, timeout=60) for u in urls]

    async def __call__(self, method: str, path: str, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + 60
        while True:
            for c in self.clients:
                try:
                    resp = await c.request(method, path, **kw)
                except httpx.TransportError:
                    continue
                if resp.status_code != 503:
                    return resp
            assert time.monotonic() < deadline, f"{method} {path}: no API answered"
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()


def tokens(partials: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    return {p["rollout_id"]: (p["response_ids"], p["logprobs"]) for p in partials}


async def test_partials_survive_generator_api_and_redis_kills(
    backend: str, database_url: str, tmp_path: Path
) -> None:
    redis_server = KillableRedis(backend, tmp_path, keys.run_key(PREFIX, RUN))
    await redis_server.start()
    apis, worker = brokers(redis_server.backend.env(), database_url, PREFIX, tmp_path)
    call = None
    try:
        await asyncio.gather(*(a.start() for a in apis), worker.start())
        call = Calls([apis[1].url, apis[0].url])
        config = {"group_size": 2, "work_timeout_s": 1.0, "max_attempts": 5}
        assert (await call("POST", "/v1/runs", json={"run_id": RUN, "config": config})).is_success
        body = {"prompts": [{"prompt_id": f"p{i}", "prompt_ids": [i, i + 1]} for i in range(4)]}
        assert (await call("POST", f"/v1/runs/{RUN}/prompts", json=body)).status_code == 202

        # A gives p0, p1 back with partials through API 0 and dies; API 0 dies before the next
        # hand-out; Redis dies and comes back from its AOF.
        given = await run_until_killed(GIVE_BACK, apis[0].url)
        await apis[0].kill()
        await redis_server.kill_run_node()
        await redis_server.restart_run_node()
        await apis[0].start()
        # C takes them (with their partials, exactly as given) and dies holding them.
        held = await run_until_killed(TAKE, apis[0].url)
        assert sorted(p["prompt_id"] for p in held) == ["p0", "p1"]
        assert tokens([q for p in held for q in p["partials"]]) == tokens(given)

        # Its lease expires: the worker's sweep sends the prompts back with their partials
        # (p2 and p3, never handed out, come first meanwhile, in leases that do not expire).
        patch = {"work_timeout_s": 60}
        assert (await call("PATCH", f"/v1/runs/{RUN}/config", json=patch)).is_success
        prompts: list[dict[str, Any]] = []
        while len(prompts) < 4:
            body = {"max_prompts": 4, "wait_s": 30}
            resp = await call("POST", f"/v1/runs/{RUN}/work", json=body)
            assert resp.status_code == 200, resp.text
            prompts += resp.json()["prompts"]
        assert sorted((p["prompt_id"], p["attempt"]) for p in prompts) == [
            ("p0", 3),
            ("p1", 3),
            ("p2", 1),
            ("p3", 1),
        ]
        again = [q for p in prompts for q in p["partials"]]
        assert tokens(again) == tokens(given)  # neither lost nor doubled
        rollouts = []
        for p in prompts:
            for k in range(2):
                rid = f"{p['prompt_id']}-{k}"
                sampled = tokens(given).get(rid, ([], []))
                rollouts.append(
                    {
                        "rollout_id": rid,
                        "group_id": p["group_id"],
                        "policy_version": 0,
                        "response_ids": sampled[0] + [7, 8],
                        "logprobs": sampled[1] + [-1.0, -1.0],
                        "reward": float(k),
                    }
                )
        resp = await call("POST", f"/v1/runs/{RUN}/rollouts", json={"rollouts": rollouts})
        assert resp.json()["accepted"] == 8, resp.text

        for step in range(4):
            bid = f"batch-{step:04d}"
            resp = await call("GET", f"/v1/runs/{RUN}/batch", params={"size": 2, "batch_id": bid})
            assert resp.status_code == 200, resp.text
            for r in resp.json()["rollouts"]:
                assert r["prompt_id"] == r["rollout_id"].split("-")[0]
                assert r["response_ids"][-2:] == [7, 8]
            assert (await call("POST", f"/v1/runs/{RUN}/batches/{bid}/ack", json={})).is_success

        deadline = time.monotonic() + 60
        while (acc := (await call("GET", f"/v1/runs/{RUN}/accounting")).json())["pending_events"]:
            assert time.monotonic() < deadline, acc
            await asyncio.sleep(0.1)
        p = acc["prompts"]
        assert p["registered"] == 4 == p["done"]
        assert p["registered"] == p["queued"] + p["in_flight"] + p["done"] + p["failed"]
        assert acc["live"] == live_of_ledger(acc)
        assert acc["samples_consumed"] == acc["rollouts_received"] == 8
        n = sum(len(x[0]) for x in tokens(given).values())
        # Given back by A, brought back by C's expiry; handed out to C, then to the last one.
        assert acc["partials"] == {
            "returned": 8,
            "resumed": 8,
            "dropped": 0,
            "tokens_resumed": 2 * n,
            "tokens_dropped": 0,
        }
        redis = redis_server.backend.client()
        try:
            left = [k async for k in redis.scan_iter(match=f"{PREFIX}:*:p[tm]:*")]
        finally:
            await redis.aclose()
        assert left == []
    finally:
        if call is not None:
            await call.close()
        await asyncio.gather(*(a.stop() for a in apis), worker.stop(), return_exceptions=True)
        await redis_server.stop()
