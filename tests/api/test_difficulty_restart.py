"""Difficulty pools through a Redis restart (SIGKILL, AOF with fsync always) and a worker
restart (SIGKILL): each prompt's reward history and the pools of its queued passes are as they
were, a work lease that expired while the worker was down is swept back into its pool by the
restarted worker, and the pools keep moving with new rewards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app import keys
from app.main import create_app
from app.settings import Settings
from app.wiring import redis_client
from tests.processes import KillableRedis, broker_env, worker_process

pytestmark = pytest.mark.slow

PREFIX = "pools-restart"
RUN = "pools"
POOL_KEYS = {"easy": keys.POOL_EASY, "normal": keys.POOL_NORMAL, "hard": keys.POOL_HARD}
MEANS = {"e0": 1.0, "e1": 0.95, "h0": 0.0, "h1": 0.1, "n0": 0.5, "n1": 0.6}


async def call(api: httpx.AsyncClient, method: str, path: str, **kw: Any) -> httpx.Response:
    """A request, resent while Redis is coming back (each one here is safe to resend)."""
    deadline = time.monotonic() + 60
    while True:
        resp = await api.request(method, path, **kw)
        if resp.status_code != 503:
            return resp
        assert time.monotonic() < deadline, f"{method} {path}: still 503"
        await asyncio.sleep(0.05)


async def live_pools(redis: Redis) -> dict[str, list[str]]:
    out = {}
    for name, suffix in POOL_KEYS.items():
        got = await redis.zrange(keys.run_key(PREFIX, RUN, suffix), 0, -1)
        out[name] = [m.decode() for m in got]
    return out


async def history(redis: Redis) -> dict[str, str]:
    got = await redis.hgetall(keys.run_key(PREFIX, RUN, keys.PROMPT_MEANS))
    return {k.decode(): v.decode() for k, v in got.items()}


async def answer(api: httpx.AsyncClient, prompts: list[dict[str, Any]], means: dict[str, float]):
    for p in prompts:
        m = means[p["prompt_id"]]
        rollouts = [
            {
                "rollout_id": f"{p['group_id']}/{i}",
                "group_id": p["group_id"],
                "policy_version": 0,
                "response_ids": [1, 2, 3],
                "reward": m,
            }
            for i in range(2)
        ]
        resp = await call(api, "POST", f"/v1/runs/{RUN}/rollouts", json={"rollouts": rollouts})
        assert resp.status_code == 202 and resp.json()["accepted"] == 2, resp.text


@pytest.fixture
async def system(backend: str, database_url: str, tmp_path: Path) -> AsyncIterator[Any]:
    server = KillableRedis(backend, tmp_path, keys.run_key(PREFIX, RUN))
    await server.start()
    env = broker_env(
        **server.backend.env(),
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=PREFIX,
        BROKER_SWEEP_INTERVAL_S="0.1",
        BROKER_DRAIN_BLOCK_MS="50",
    )
    worker = worker_process(env, tmp_path / "worker.log")
    settings = Settings(
        allowed_hosts=("broker",),
        redis_url=server.backend.url,
        redis_cluster=server.backend.cluster,
        database_url=database_url,
        redis_prefix=PREFIX,
    )
    app = create_app(settings)
    redis = redis_client(settings)
    try:
        await worker.start()
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://broker", timeout=30
            ) as api:
                yield server, worker, api, redis
    finally:
        await redis.aclose()
        await worker.stop()
        await server.stop()


async def test_pools_and_history_survive_redis_and_worker_kills(system) -> None:
    server, worker, api, redis = system
    config = {
        "group_size": 2,
        "work_timeout_s": 600,
        "difficulty": {"easy_above": 0.9, "hard_below": 0.2},
    }
    assert (await call(api, "POST", "/v1/runs", json={"run_id": RUN, "config": config})).is_success
    body = {"prompts": [{"prompt_id": p} for p in MEANS], "epochs": 3}
    assert (await call(api, "POST", f"/v1/runs/{RUN}/prompts", json=body)).status_code == 202
    first = (await call(api, "POST", f"/v1/runs/{RUN}/work", json={"max_prompts": 6})).json()
    await answer(api, first["prompts"], MEANS)
    pools = await live_pools(redis)
    assert {n: sorted({m.split("#")[0] for m in ms}) for n, ms in pools.items()} == {
        "easy": ["e0", "e1"],
        "hard": ["h0", "h1"],
        "normal": ["n0", "n1"],
    }
    means = await history(redis)
    assert {p: float(m) for p, m in means.items()} == MEANS

    # A work lease whose time runs out while the worker is down, then both die.
    await call(api, "PATCH", f"/v1/runs/{RUN}/config", json={"work_timeout_s": 0.5})
    held = (await call(api, "POST", f"/v1/runs/{RUN}/work", json={"max_prompts": 2})).json()
    held_passes = sorted(f"{p['prompt_id']}#{p['pass']}" for p in held["prompts"])
    await worker.kill()
    await server.kill_run_node()
    await server.restart_run_node()
    assert await history(redis) == means
    after = await live_pools(redis)
    assert after == {n: [m for m in ms if m not in held_passes] for n, ms in pools.items()}
    # The restarted worker's sweep brings the expired lease's passes back into their pools.
    await worker.start()
    deadline = time.monotonic() + 30
    while await live_pools(redis) != pools:
        assert time.monotonic() < deadline, (await live_pools(redis), pools)
        await asyncio.sleep(0.05)

    # New rewards still move prompts: e0's next group is hard, and its last pass follows it.
    await call(api, "PATCH", f"/v1/runs/{RUN}/config", json={"work_timeout_s": 600})
    weights = {"easy": 1, "normal": 0, "hard": 0}
    difficulty = {**config["difficulty"], "weights": weights}
    await call(api, "PATCH", f"/v1/runs/{RUN}/config", json={"difficulty": difficulty})
    got = (await call(api, "POST", f"/v1/runs/{RUN}/work", json={"max_prompts": 1})).json()
    assert got["prompts"][0]["prompt_id"] in {"e0", "e1"}
    pid = got["prompts"][0]["prompt_id"]
    await answer(api, got["prompts"], {pid: 0.0})
    assert f"{pid}#3" in (await live_pools(redis))["hard"]
    assert float((await history(redis))[pid]) == 0.0
