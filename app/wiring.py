"""The composition root: the connections and services that the API and the workers share, each
built here from :class:`~app.settings.Settings`. ``workers/`` imports from here; nothing under
``app/`` imports ``workers/`` except the command line, which starts them."""

from __future__ import annotations

import asyncio
import re
from typing import cast
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.broker.notify import Waker
from app.broker.prompt_limits import PromptLimits
from app.broker.service import Broker
from app.broker.store import RedisStore
from app.db import create_engine
from app.replicas import Replicas
from app.settings import Settings

__all__ = [
    "MIN_REDIS_VERSION",
    "RedisTooOldError",
    "broker_for",
    "check_redis_version",
    "cluster_client",
    "database_engine",
    "redis_client",
    "replicas_for",
]

_TIMEOUT_S: float = Settings.model_fields["redis_timeout_s"].default


def redis_client(settings: Settings) -> Redis:
    """A client for ``BROKER_REDIS_URL``; embedded mode must have filled it in first."""
    if settings.redis_url is None:
        raise ValueError(
            "BROKER_REDIS_URL is not set (`rollout-broker serve` starts embedded services)"
        )
    # Blobs and Lua replies are bytes; decoding is the store's business.
    # The timeouts are the broker's setting, not redis-py's default: without one (redis-py
    # before 8.0) a Redis that stops answering holds requests for good, and the drain's
    # blocked read is checked against it (Settings).
    timeout = settings.redis_timeout_s
    if settings.redis_cluster:
        return cast(Redis, cluster_client(settings.redis_url, timeout_s=timeout))
    return Redis.from_url(
        settings.redis_url,
        decode_responses=False,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )


def cluster_client(url: str, *, timeout_s: float = _TIMEOUT_S) -> RedisCluster:
    """A Redis Cluster client from any node's URL, or several (``redis://a:7000,b:7001``: the
    client starts from the first that answers). Every key of a run shares its hash tag, so each
    script, MGET and XREADGROUP the broker sends touches one slot; the client routes it and
    follows MOVED and ASK redirections."""
    first, *more = url.split(",")
    # from_url adds the first URL's node to the seeds; credentials and TLS of the first URL
    # apply to every node.
    seeds = [ClusterNode(*_host_port(part)) for part in more]
    return RedisCluster.from_url(
        first,
        startup_nodes=seeds or None,
        decode_responses=False,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


MIN_REDIS_VERSION = (7, 0)
"""The oldest Redis the broker runs on; every Valkey from 7.2 on reports a redis_version of 7.2."""


class RedisTooOldError(RuntimeError):
    """A Redis that answered is older than :data:`MIN_REDIS_VERSION`."""


async def check_redis_version(redis: Redis | RedisCluster, settings: Settings) -> bool:
    """Refuse a Redis older than 7.0 (on a cluster, any node): :class:`RedisTooOldError`,
    naming where it is, its version and the one needed. True once every node told its version
    (``INFO server``); False when that could not be asked (Redis down, or INFO refused): the
    caller may go on, and ask again later."""
    try:
        async with asyncio.timeout(settings.redis_timeout_s):
            if isinstance(redis, RedisCluster):
                infos = await redis.info("server", target_nodes=RedisCluster.ALL_NODES)
                nodes = {"": infos} if "redis_version" in infos else infos  # one node: as is
            else:
                nodes = {"": await redis.info("server")}
    except (RedisError, RedisClusterException, OSError, TimeoutError):
        return False
    for node, info in nodes.items():
        found = re.match(r"(\d+)\.(\d+)", str(info.get("redis_version", "")))
        if found and (int(found[1]), int(found[2])) < MIN_REDIS_VERSION:
            valkey = f"Valkey {info['valkey_version']}, " if "valkey_version" in info else ""
            raise RedisTooOldError(
                f"the Redis at {node or _where(settings.redis_url or '')} is too old: "
                f"{valkey}redis_version {info['redis_version']}; the broker needs Redis 7.0 or "
                "later (or Valkey 7.2 or later)"
            )
    return True


def _where(url: str) -> str:
    """A Redis URL's host and port, or its socket's path; never its credentials."""
    where = urlsplit(url.split(",")[0])
    if where.scheme == "unix":
        return unquote(where.path)
    return f"{where.hostname}:{where.port or 6379}"


def _host_port(part: str) -> tuple[str, int]:
    where = urlsplit(part if "//" in part else f"//{part}")
    if not where.hostname:
        raise ValueError(f"BROKER_REDIS_URL: no host in {part!r}")
    return where.hostname, where.port or 6379


def broker_for(redis: Redis, settings: Settings) -> Broker:
    """The broker's rules over ``redis``, with the request limits of ``settings``."""
    store = RedisStore(redis, settings.redis_prefix, replicas_for(redis, settings))
    return Broker(
        store,
        Waker(redis, settings.redis_prefix, settings.wake_fallback_s),
        max_tokens_per_rollout=settings.max_tokens_per_rollout,
        max_rollouts_per_request=settings.max_rollouts_per_request,
        max_batch_size=settings.max_batch_size,
        max_wait_s=settings.max_wait_s,
        retry_after_s=settings.retry_after_s,
        behaviour_cache_bytes=settings.behaviour_cache_bytes,
        prompt_limits=PromptLimits(
            per_request=settings.max_prompts_per_request,
            tokens=settings.max_tokens_per_prompt,
            data_bytes=settings.max_prompt_data_bytes,
            per_lease=settings.max_prompts_per_lease,
        ),
    )


def replicas_for(redis: Redis, settings: Settings) -> Replicas | None:
    """What makes a write wait for ``BROKER_REDIS_WAIT_REPLICAS`` replicas; None when it is 0."""
    if settings.redis_wait_replicas == 0:
        return None
    return Replicas(
        redis,
        settings.redis_wait_replicas,
        settings.redis_wait_timeout_ms,
        retry_after_s=settings.retry_after_s,
    )


def database_engine(settings: Settings) -> AsyncEngine | None:
    """The accounting database's engine, or None when ``BROKER_DATABASE_URL`` is not set."""
    return create_engine(settings.database_url) if settings.database_url else None
