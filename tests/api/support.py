"""Helpers for the HTTP contract tests: error-body checks, the accounting event stream,
request builders for raw and msgpack bodies."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import msgpack
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from app import keys
from app.broker.store import RedisStore

# The SPEC's RunConfig defaults.
DEFAULT_CONFIG: dict[str, Any] = {
    "max_staleness": 1,
    "max_reuse": 1,
    "kl_max": 0.05,
    "kl_flush": 0.1,
    "kl_flush_window": 1,
    "kl_coef": None,
    "kl_target": 0.02,
    "kl_horizon": 10000,
    "kl_estimator": "k3",
    "clip_epsilon": 0.2,
    "group_size": 1,
    "group_timeout_s": 600.0,
    "drop_zero_variance_groups": False,
    "order": "auto",
    "stale_tokens": "keep",
    "capacity_rollouts": 100000,
    "lease_timeout_s": 300.0,
    "step_groups": None,
    "work_timeout_s": 1800.0,
    "max_attempts": 3,
    "reward_timeout_s": 600.0,
    "max_reward_attempts": 3,
    "correction": {"level": "token", "mode": "truncate", "low": 0.0, "high": 2.0},
    "generator_kl_max": None,
    "generator_window_tokens": 100000,
    "difficulty": None,
}

MSGPACK = {"content-type": "application/msgpack"}
JSON = {"content-type": "application/json"}


def _no_constants(name: str) -> Any:
    raise AssertionError(f"response body is not strict JSON: it contains {name}")


def strict_json(resp: httpx.Response) -> Any:
    """The body parsed as strict JSON (NaN/Infinity are not JSON and fail the test)."""
    return json.loads(resp.content, parse_constant=_no_constants)


def assert_error(resp: httpx.Response, status: int, name: str) -> str:
    """The response is the SPEC's error body; returns its detail."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = strict_json(resp)
    assert set(body) == {"error", "detail"}, body
    assert body["error"] == name, body
    assert isinstance(body["detail"], str)
    assert body["detail"].strip(), body
    return str(body["detail"])


async def events(redis: Redis, prefix: str, run_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The run's accounting events (docs/events.md), oldest first, `d` decoded."""
    out = []
    for _entry_id, fields in await redis.xrange(keys.events_key(prefix, run_id)):
        out.append((fields[b"e"].decode(), msgpack.unpackb(fields[b"d"], raw=False)))
    return out


async def retired(redis: Redis, prefix: str, run_id: str) -> dict[str, list[str]]:
    """reason -> sorted rollout ids, from the run's `retired` events."""
    res: dict[str, list[str]] = {}
    for e, d in await events(redis, prefix, run_id):
        if e == "retired":
            res.setdefault(d["reason"], []).extend(item[0] for item in d["items"])
    return {k: sorted(v) for k, v in res.items()}


async def retired_items(redis: Redis, prefix: str, run_id: str) -> dict[str, list[list[Any]]]:
    """reason -> the raw items [rollout_id, policy_version, tokens, uses] of `retired` events."""
    res: dict[str, list[list[Any]]] = {}
    for e, d in await events(redis, prefix, run_id):
        if e == "retired":
            res.setdefault(d["reason"], []).extend(d["items"])
    return res


async def post_raw(
    client: httpx.AsyncClient, run_id: str, body: bytes, content_type: str = "application/json"
) -> httpx.Response:
    return await client.post(
        f"/v1/runs/{run_id}/rollouts", content=body, headers={"content-type": content_type}
    )


async def post_msgpack(
    client: httpx.AsyncClient, run_id: str, rollouts: list[dict[str, Any]]
) -> httpx.Response:
    body = msgpack.packb({"rollouts": rollouts}, use_bin_type=True)
    return await post_raw(client, run_id, body, "application/msgpack")


async def nack(client: httpx.AsyncClient, run_id: str, batch_id: str) -> httpx.Response:
    return await client.post(f"/v1/runs/{run_id}/batches/{batch_id}/nack")


async def set_policy(client: httpx.AsyncClient, run_id: str, version: int) -> dict[str, Any]:
    resp = await client.post(f"/v1/runs/{run_id}/policy", json={"version": version})
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


async def patch(client: httpx.AsyncClient, run_id: str, **fields: Any) -> dict[str, Any]:
    resp = await client.patch(f"/v1/runs/{run_id}/config", json=fields)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def ids(batch: dict[str, Any]) -> list[str]:
    return [r["rollout_id"] for r in batch["rollouts"]]


@contextlib.asynccontextmanager
async def asgi_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``app`` in this process (no socket), inside the app's lifespan; an exception
    in the app is answered as the app's error handling answers it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            yield c


async def run_keys(redis: Redis, prefix: str, run_id: str) -> list[bytes]:
    return [k async for k in redis.scan_iter(match=f"{prefix}:{{{run_id}}}:*", count=1000)]


async def replica_of(redis: Redis, prefix: str, run_id: str) -> dict[bytes, tuple[bytes, int]]:
    """What a replica has of the run's keys, to :func:`promote` later: each key's DUMP and
    time to live."""
    return {
        k: (await redis.dump(k), max(await redis.pttl(k), 0))
        for k in await run_keys(redis, prefix, run_id)
    }


async def promote(
    redis: Redis, prefix: str, run_id: str, replica: dict[bytes, tuple[bytes, int]]
) -> None:
    """The run's keys as the replica had them, as after a failover to that replica: what the
    master wrote since is gone."""
    for key in await run_keys(redis, prefix, run_id):
        await redis.delete(key)
    for key, (dumped, ttl_ms) in replica.items():
        await redis.restore(key, ttl_ms, dumped, replace=True)


def fail_over_before_first(
    monkeypatch: pytest.MonkeyPatch,
    store: RedisStore,
    read: Literal["blobs", "prompt_blobs"],
    redis: Redis,
    prefix: str,
    run_id: str,
    replica: dict[bytes, tuple[bytes, int]],
) -> list[list[str]]:
    """Make the store's first ``read`` (``blobs`` or ``prompt_blobs``: the read a lease or work
    script's reply is followed by) reach a promoted ``replica`` of the run, as a client that
    carries a command over a failover does (redis-py 8.2). Returns the list that the ids of
    that first read are put in."""
    original = getattr(store, read)
    failovers: list[list[str]] = []

    async def after_a_failover(rid: str, ids: list[str]) -> list[bytes | None]:
        if not failovers:
            failovers.append(list(ids))
            await promote(redis, prefix, run_id, replica)
        got: list[bytes | None] = await original(rid, ids)
        return got

    monkeypatch.setattr(store, read, after_a_failover)
    return failovers
