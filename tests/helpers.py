"""Builders shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

import httpx
from redis.asyncio import Redis

from app.accounting.consumers import ConsumerGroup
from app.caller import Caller
from app.keys import WAITING, run_key

OPS = Caller(token_id="t-ops", name="ops", scopes=frozenset({"operate"}))
"""An operator, for the broker's run actions called without HTTP (their audit entries name it)."""


def rollout(
    rid: str,
    version: int = 0,
    *,
    tokens: int = 4,
    group: str | None = None,
    reward: float | None = 1.0,
    logprobs: list[float] | bool | None = True,
) -> dict[str, Any]:
    r: dict[str, Any] = {
        "rollout_id": rid,
        "policy_version": version,
        "prompt_ids": [1, 2, 3],
        "response_ids": [10 + i for i in range(tokens)],
        "reward": reward,
        "finish_reason": "stop",
    }
    if logprobs is True:
        r["logprobs"] = [-0.5] * tokens
    elif isinstance(logprobs, list):
        r["logprobs"] = logprobs
    if group is not None:
        r["group_id"] = group
    return r


def answers_for(prompt: dict[str, Any], version: int, n: int = 2) -> list[dict[str, Any]]:
    """``n`` three-token responses to a prompt handed out by a work lease, posted under its
    ``group_id`` at ``version`` (the lease's), rewards 0, 1, ...: what a test's generator sends."""
    gid = prompt["group_id"]
    return [
        {
            "rollout_id": f"{gid}/{i}",
            "group_id": gid,
            "policy_version": version,
            "response_ids": [1, 2, 3],
            "reward": float(i),
        }
        for i in range(n)
    ]


def live_of_ledger(acc: dict[str, Any]) -> dict[str, Any]:
    """The ``live`` counts an accounting answer must carry when its ledger agrees with the
    broker's live state: buffered, leased, and the rollouts awaiting a reward (in no reward
    lease, and in one)."""
    rewards = acc["rewards"]
    return {
        "buffered": acc["buffered"],
        "leased": acc["leased"],
        "rewards": {"awaiting": rewards["awaiting"], "leased": rewards["leased"]},
    }


async def make_run(client: httpx.AsyncClient, run_id: str = "r1", **config: Any) -> dict[str, Any]:
    resp = await client.post("/v1/runs", json={"run_id": run_id, "config": config})
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


async def post(client: httpx.AsyncClient, run_id: str, *rollouts: dict[str, Any]) -> httpx.Response:
    return await client.post(f"/v1/runs/{run_id}/rollouts", json={"rollouts": list(rollouts)})


async def lease(client: httpx.AsyncClient, run_id: str, size: int, **params: Any) -> httpx.Response:
    q = {
        "size": size,
        **{k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items()},
    }
    return await client.get(f"/v1/runs/{run_id}/batch", params=q)


async def ack(client: httpx.AsyncClient, run_id: str, batch_id: str, **body: Any) -> httpx.Response:
    return await client.post(f"/v1/runs/{run_id}/batches/{batch_id}/ack", json=body)


async def drain_heartbeat(redis: Redis, prefix: str) -> None:
    """One heartbeat of an accounting drain consumer, as a running worker sends it (so /readyz
    counts a worker alive for the next minute), for tests about anything but the workers."""
    await ConsumerGroup(redis, prefix).beat("tests-drain")


async def until_long_polling(redis: Redis, prefix: str, run_id: str, mark: str = WAITING) -> None:
    """Returns once a lease on the run waits for a wake-up: its script marks the run as waited
    on just before the caller starts waiting, so a rollout posted after this must wake it.
    ``mark=WORK_WAITING``: a work request (generator) waits instead."""
    # Another task or process sets the mark, and Redis has no way to push it to us: look again.
    while True:
        if await redis.exists(run_key(prefix, run_id, mark)):
            return
        await asyncio.sleep(0.01)


async def answered_before(
    answer: asyncio.Task[httpx.Response], idle: asyncio.Task[httpx.Response]
) -> httpx.Response:
    """``answer``'s response, which must come while ``idle`` (a long poll on a run that gets no
    rollouts, with a shorter ``wait_s``) still waits. A long poll makes one last try at its
    deadline, so a batch alone does not show that a wake-up answered it; this order does."""
    done, _ = await asyncio.wait({answer, idle}, return_when=asyncio.FIRST_COMPLETED)
    for task in (idle, answer):
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert answer in done, "no wake-up: a long poll that nothing wakes ended first"
    return answer.result()


SECRET_SHAPE = re.compile(r"rb_[0-9a-f]{16}_[A-Za-z0-9_-]{20,}")
"""A broker token (app/access/tokens.py)."""
KNOWN_SECRETS: set[str] = set()
"""Secrets the tests chose (e.g. a bootstrap admin token): no log line may hold one."""


class SecretWatch(logging.Handler):
    """Collects every log record whose text (message, arguments, traceback) holds a token or a
    known secret; tests/conftest.py installs one for the whole session."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.leaks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = logging.Formatter().format(record)
        except Exception:
            text = f"{record.msg!r} {record.args!r}"
        if SECRET_SHAPE.search(text) or any(s in text for s in KNOWN_SECRETS):
            self.leaks.append(f"{record.name}: {text[:300]}")
