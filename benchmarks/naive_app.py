"""The baseline a team writes on a first day: a FastAPI app that keeps JSON rollouts in a Python
dict and pops them on read, one rollout per request. No Redis, no leases, no accounting.

Run: ``python -m uvicorn benchmarks.naive_app:app``.

It also serves two floors, measured beside the broker rather than compared for speed: the HTTP
floor of a lease + ack (canned answers) and the durable floor of an ingest (each body kept in
Redis before the answer), see the end of this file.
"""

from __future__ import annotations

import itertools
import os

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel
from redis.asyncio import Redis


class Rollout(BaseModel):
    rollout_id: str
    group_id: str | None = None
    policy_version: int
    prompt_ids: list[int] | None = None
    response_ids: list[int]
    logprobs: list[float] | None = None
    reward: float
    finish_reason: str | None = None
    metadata: dict[str, object] | None = None


app = FastAPI(title="naive rollout buffer")
buffer: dict[str, Rollout] = {}


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/rollouts", status_code=202)
async def put_rollout(rollout: Rollout) -> dict[str, int]:
    buffer[rollout.rollout_id] = rollout
    return {"accepted": 1}


@app.get("/rollouts/next", response_model=Rollout, responses={204: {}})
async def pop_rollout() -> Rollout | Response:
    if not buffer:
        return Response(status_code=204)
    return buffer.pop(next(iter(buffer)))


# -- benchmark set-up only (not part of the baseline's measured paths) -----------------------
@app.post("/_bench/replicate", status_code=202)
async def replicate(n: int, prefix: str) -> dict[str, int]:
    """Fill the buffer with ``n`` copies of one stored rollout under new ids, so that read
    benchmarks need not first post thousands of rollouts one by one."""
    model = next(iter(buffer.values()))
    for i in range(n):
        rid = f"{prefix}{i}"
        buffer[rid] = model.model_copy(update={"rollout_id": rid})
    return {"accepted": n}


@app.post("/_bench/clear")
async def clear() -> dict[str, int]:
    n = len(buffer)
    buffer.clear()
    return {"cleared": n}


# -- the HTTP floor: the broker's lease and ack requests, answered from memory ------------------
# Same paths, bodies and sizes as the broker's msgpack lease and ack, with no work behind them:
# what one uvicorn process on this machine costs just to move a batch out and its ack back in.
# The run id names the rollouts' length: "canned" 1,024 tokens, "canned-<n>" n tokens.
_canned: dict[tuple[int, int], bytes] = {}


def _canned_batch(size: int, tokens: int) -> bytes:
    if (size, tokens) not in _canned:
        import msgpack

        from benchmarks.payloads import make_payload

        p = make_payload(tokens=tokens)
        item = {
            "group_id": None,
            "policy_version": 0,
            "prompt_ids": None,
            "response_ids": p.ids.tobytes(),
            "logprobs": p.logprobs.tobytes(),
            "reward": 1.0,
            "finish_reason": "stop",
            "metadata": None,
            "uses": 0,
            "lag": 0,
        }
        _canned[size, tokens] = msgpack.packb(
            {
                "batch_id": "canned",
                "policy_version": 0,
                "lease_expires_at": "2026-01-01T00:00:00Z",
                "rollouts": [{"rollout_id": f"{i:032d}", **item} for i in range(size)],
            },
            use_bin_type=True,
        )
    return _canned[size, tokens]


@app.get("/v1/runs/{run_id}/batch")
async def canned_lease(run_id: str, size: int) -> Response:
    _, _, tokens = run_id.partition("-")
    batch = _canned_batch(size, int(tokens) if tokens else 1024)
    return Response(batch, media_type="application/msgpack")


@app.post("/v1/runs/{run_id}/batches/{batch_id}/ack")
async def canned_ack(run_id: str, batch_id: str, request: Request) -> Response:
    body = await request.body()
    return Response(b'{"consumed":%d}' % len(body), media_type="application/json")


# -- the durable floor of an ingest: one Redis write per request -------------------------------
# The naive app's own framework and route, plus one SET of the request's body, as it came, before
# the answer: no parsing, no checks, no accounting. It is the least that a buffer which keeps
# what it accepted outside its own process (so that a restart loses nothing) pays per request,
# on this machine. The benchmark passes its Redis and a key prefix it deletes afterwards.
_floor: tuple[Redis, str] | None = None  # the client and the key prefix, made at first use
_floor_seq = itertools.count()


@app.post("/_floor/rollouts", status_code=202)
async def floor_rollout(request: Request) -> dict[str, int]:
    global _floor
    if _floor is None:
        url, prefix = os.environ["BENCH_FLOOR_REDIS_URL"], os.environ["BENCH_FLOOR_PREFIX"]
        _floor = Redis.from_url(url), prefix
    client, prefix = _floor
    await client.set(f"{prefix}{next(_floor_seq)}", await request.body())
    return {"accepted": 1}
