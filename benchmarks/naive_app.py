"""The baseline a team writes on a first day: a FastAPI app that keeps JSON rollouts in a Python
dict and pops them on read, one rollout per request. No Redis, no leases, no accounting.

Run: ``python -m uvicorn benchmarks.naive_app:app``.
"""

from __future__ import annotations

from fastapi import FastAPI, Response
from pydantic import BaseModel


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
