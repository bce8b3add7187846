"""How long a rewind holds Redis: ``python -m benchmarks.rewind_cost``.

A rewind is one script, atomic against every other call of its run, so while it runs Redis
serves nobody else. This builds runs with a given number of rollouts buffered and of batches of
64 acknowledged above the rewind's version (each a use the rewind gives back), plus 1,000
rollouts sampled above it (which it retires), rewinds each, and reads the script's own time from
Redis's SLOWLOG beside the median time of the ack script in the same run: the rewind's cost as
a number of acks. The app runs in-process against ``--redis-url`` under a prefix of its own,
which it deletes at the end; it needs no Postgres.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any

import httpx
from redis.asyncio import Redis

from app.broker.scripts import LIBRARY
from app.main import create_app
from app.settings import Settings

BATCH = 64
ABOVE = 1000  # rollouts sampled above the rewind's version


async def one(redis_url: str, buffered: int, batches: int) -> dict[str, Any]:
    prefix = f"rewind-cost-{os.getpid()}"
    app = create_app(Settings(redis_url=redis_url, redis_prefix=prefix, allowed_hosts=("b",)))
    redis = Redis.from_url(redis_url)
    posted = 0
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://b", timeout=120
            ) as c,
        ):

            async def call(method: str, path: str, **kw: Any) -> Any:
                resp = await c.request(method, f"/v1/runs/r{path}", **kw)
                assert resp.status_code < 300, resp.text
                return resp.json() if resp.content else None

            async def post(n: int, version: int) -> None:
                nonlocal posted
                for start in range(0, n, 1000):
                    k = min(1000, n - start)
                    rollouts = [
                        {
                            "rollout_id": f"x{posted + j}",
                            "policy_version": version,
                            "response_ids": list(range(16)),
                            "reward": 1.0,
                        }
                        for j in range(k)
                    ]
                    posted += k
                    await call("POST", "/rollouts", json={"rollouts": rollouts})

            config = {"max_reuse": 2, "max_staleness": 1000, "capacity_rollouts": 10**7}
            resp = await c.post("/v1/runs", json={"run_id": "r", "config": config})
            assert resp.status_code == 201, resp.text
            await call("POST", "/policy", json={"version": 1})
            await post(buffered, 0)
            await redis.config_set("slowlog-log-slower-than", 0)
            await redis.config_set("slowlog-max-len", 4 * batches + 64)
            await redis.slowlog_reset()
            version = 1
            for i in range(batches):  # versions 2, 3, ...: ten batches each
                if i % 10 == 0:
                    version += 1
                    await call("POST", "/policy", json={"version": version})
                batch = await call("GET", "/batch", params={"size": BATCH})
                await call("POST", f"/batches/{batch['batch_id']}/ack", json={})
            acks = await script_times(redis, "ack")
            await post(ABOVE, version)
            await redis.slowlog_reset()
            answer = await call("POST", "/policy", json={"version": 1, "rewind": True})
            (rewind,) = await script_times(redis, "rewind")
            assert answer == {"policy_version": 1, "evicted": ABOVE}, answer
    finally:
        await redis.config_set("slowlog-log-slower-than", 10000)
        await redis.config_set("slowlog-max-len", 128)
        async for key in redis.scan_iter(match=f"{prefix}:*", count=1000):
            await redis.unlink(key)
        await redis.aclose()
    ack_us = statistics.median(acks)
    return {
        "buffered": buffered,
        "uses": batches * BATCH,
        "rewind_ms": rewind / 1000,
        "ack_us": ack_us,
        "acks": rewind / ack_us,
        "per_use_us": rewind / (batches * BATCH),
    }


async def script_times(redis: Redis, name: str) -> list[float]:
    """The durations (µs) SLOWLOG holds of the broker's script ``name`` (its function)."""
    function = LIBRARY.functions[name].encode()
    return [
        float(entry["duration"])
        for entry in await redis.slowlog_get(100000)
        if entry["command"].split()[:2] == [b"FCALL", function]
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument(
        "--sizes",
        default="10000:100,100000:1000",
        help="buffered:batches pairs, comma-separated",
    )
    args = p.parse_args()
    print(
        "| rollouts buffered | uses given back | rewind script | ack script (median) | ×ack "
        "| per use |"
    )
    print("|---|---|---|---|---|---|")
    for pair in args.sizes.split(","):
        buffered, batches = (int(x) for x in pair.split(":"))
        r = asyncio.run(one(args.redis_url, buffered, batches))
        print(
            f"| {r['buffered']:,} | {r['uses']:,} | {r['rewind_ms']:.1f} ms | "
            f"{r['ack_us']:,.0f} µs | ×{r['acks']:.0f} | {r['per_use_us']:.1f} µs |"
        )


if __name__ == "__main__":
    main()
