"""Builders shared by the tests."""

from __future__ import annotations

from typing import Any

import httpx


def rollout(
    rid: str,
    version: int = 0,
    *,
    tokens: int = 4,
    group: str | None = None,
    reward: float = 1.0,
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
