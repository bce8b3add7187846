"""Liveness and readiness."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from app import keys
from app.api import errors, render
from app.errors import write_refusal_of
from app.wiring import RedisTooOldError, check_redis_version

router = APIRouter(tags=["health"])


class Alive(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    checks: dict[str, Literal["ok"]]


@router.get("/healthz", response_model=Alive)
async def healthz() -> Response:
    return render({"status": "ok"})


@router.get(
    "/readyz",
    response_model=Ready,
    responses=errors(
        (
            503,
            "Redis or Postgres is unreachable, Redis refuses writes or is older than 7.0, a "
            "Redis master has fewer replicas than BROKER_REDIS_WAIT_REPLICAS, Postgres is not "
            "migrated, or no background worker has drained the accounting within the last minute",
        )
    ),
)
async def readyz(request: Request) -> Response:
    settings = request.app.state.settings
    checks: dict[str, Any] = {
        "redis": await redis_check(request.app.state.redis, settings.redis_prefix)
    }
    if checks["redis"] == "ok" and not request.app.state.redis_version_known:
        checks["redis"] = await version_check(request.app)
    if settings.redis_wait_replicas and checks["redis"] == "ok":
        checks["replicas"] = await replicas_check(
            request.app.state.redis, settings.redis_wait_replicas
        )
    probe = getattr(request.app.state, "readiness_probe", None)
    if probe is not None:
        checks.update(await probe())
    ready = all(v == "ok" for v in checks.values())
    if not ready:
        failing = ", ".join(f"{k} {v}" for k, v in checks.items() if v != "ok")
        return render({"error": "Unavailable", "detail": f"not ready: {failing}"}, status_code=503)
    return render({"status": "ready", "checks": checks})


async def redis_check(redis: Redis | RedisCluster, prefix: str) -> str:
    """``"ok"`` when Redis takes writes, on a cluster every master. The probe deletes a key
    that never exists: a write, which Redis refuses as it would any (NOREPLICAS while a master
    has fewer replicas than its min-replicas-to-write, READONLY from a replica), and which
    otherwise changes nothing and replicates nothing. One round trip, as a PING."""
    outcomes = await asyncio.gather(
        *(redis.delete(key) for key in _probe_keys(redis, prefix)), return_exceptions=True
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException):  # reported, not raised
            refused = write_refusal_of(outcome)
            if refused is not None:
                return f"refuses writes: {refused}"
            return f"unreachable: {type(outcome).__name__}"
    return "ok"


async def version_check(app: FastAPI) -> str:
    """``"ok"`` unless Redis is older than 7.0. Asked only while the version is not known: when
    Redis could not be asked at the app's start (the start asked one that answered)."""
    try:
        app.state.redis_version_known = await check_redis_version(
            app.state.redis, app.state.settings
        )
    except RedisTooOldError as exc:
        return f"not supported: {exc}"
    return "ok"


async def replicas_check(redis: Redis | RedisCluster, wanted: int) -> str:
    """``"ok"`` when every master has ``wanted`` replicas connected (``INFO replication``, one
    round trip per master). Connected is not in sync: a replica that stopped acknowledging
    still counts, and the writes waiting for it answer 503 themselves; this tells a deployment
    at once that none can succeed, as when a master has no replica at all."""
    try:
        if isinstance(redis, RedisCluster):
            infos = await redis.info("replication", target_nodes=RedisCluster.PRIMARIES)
            each = [infos] if "role" in infos else list(infos.values())  # one master: as is
            found = [int(info.get("connected_slaves", 0)) for info in each]
        else:
            found = [int((await redis.info("replication")).get("connected_slaves", 0))]
    except Exception as exc:  # reported, not raised
        return f"unreachable: {type(exc).__name__}"
    fewest = min(found, default=0)
    if fewest < wanted:
        return f"{fewest} connected, {wanted} asked for (BROKER_REDIS_WAIT_REPLICAS)"
    return "ok"


def _probe_keys(redis: Redis | RedisCluster, prefix: str) -> list[str]:
    """One probe key per master: on a cluster, the first tags that reach every master."""
    if not isinstance(redis, RedisCluster):
        return [keys.write_probe_key(prefix)]
    masters = {node.name for node in redis.get_primaries()}
    found: dict[str, str] = {}
    tag = 0
    while masters - found.keys() and tag < 1 << 16:  # ~n·ln(n) tags for n masters
        key = keys.write_probe_key(prefix, tag)
        node = redis.get_node_from_key(key)
        if node is not None:
            found.setdefault(node.name, key)
        tag += 1
    return list(found.values()) or [keys.write_probe_key(prefix)]  # no slot map yet
