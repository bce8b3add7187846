"""Calls of a Redis 7 function library (``FUNCTION LOAD``, ``FCALL``): the one way the broker
runs its Lua (app/broker/scripts.py builds the library). A server that lacks the library (a
new one, a restart without persistence, ``FUNCTION FLUSH``, a node that joined a cluster)
answers ``Function not found``: the library is loaded there and the call made again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.exceptions
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

__all__ = ["call", "function_missing", "load_command"]


def function_missing(reply: Any) -> bool:
    """Whether ``reply`` (an exception or a value) says the server lacks the function."""
    return isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith(
        "Function not found"
    )


def load_command(code: str) -> tuple[str, ...]:
    """The command that loads library ``code``. With ``REPLACE``, loading it again is harmless
    (a library's name carries its code's digest), so processes that load it at once all
    succeed."""
    return ("FUNCTION", "LOAD", "REPLACE", code)


async def call(
    client: Redis | RedisCluster, function: str, code: str, keys: Sequence[Any], args: Sequence[Any]
) -> Any:
    """The reply of ``function`` (of library ``code``) run with ``keys`` and ``args``; on a
    cluster, on the master of the keys' slot, and the library loaded on every master first
    when that one lacked it."""
    try:
        return await client.fcall(function, len(keys), *keys, *args)
    except redis.exceptions.ResponseError as err:
        if not function_missing(err):
            raise
    await client.function_load(code, replace=True)
    return await client.fcall(function, len(keys), *keys, *args)
