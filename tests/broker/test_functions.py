"""The function library on a server that lacks it: the first call loads it (on a cluster, on
every master) and is answered; the call's own errors are not taken for a missing library.

A library of another digest stands in for a server that lost this one (a restart without
persistence, FUNCTION FLUSH, a node that joined): flushing the shared servers' functions would
pull the library from under the tests running beside this one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from app import keys
from app.broker.replies import StoreError, decode
from app.broker.scripts import LIBRARY
from app.functions import call, function_missing


@pytest.fixture
async def other_library(redis: Redis) -> AsyncIterator[tuple[str, str]]:
    """(name, code) of a copy of the library under another name, deleted afterwards."""
    name = LIBRARY.name + "0"
    yield name, LIBRARY.code.replace(LIBRARY.name, name)
    with contextlib.suppress(ResponseError):  # not loaded: the test failed first
        await redis.function_delete(name)


async def masters_with(client: Redis, library: str) -> list[bool]:
    """For each master (the one node), whether it has ``library``."""
    nodes = client.get_primaries() if isinstance(client, RedisCluster) else [None]
    found = []
    for node in nodes:
        kwargs = {"target_nodes": node} if node is not None else {}
        listed = await client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", library, **kwargs)
        found.append(bool(listed))
    return found


async def test_a_server_without_the_library_is_given_it_and_answers(redis, prefix, other_library):
    name, code = other_library
    function = LIBRARY.functions["policy_view"].replace(LIBRARY.name, name)
    assert await masters_with(redis, name) == [False] * len(await masters_with(redis, name))
    script_keys = keys.script_keys(prefix, "r")
    reply = await call(redis, function, code, script_keys, [keys.wake_channel(prefix, "r"), "", 0])
    with pytest.raises(StoreError) as refused:  # the script ran: it found no run
        decode("policy_view", reply)
    assert refused.value.code == "run_missing"
    assert all(await masters_with(redis, name))


async def test_an_error_of_the_call_itself_is_raised_and_loads_nothing(redis, other_library):
    name, code = other_library
    function = LIBRARY.functions["policy_view"].replace(LIBRARY.name, name)
    await redis.function_load(code, replace=True)
    with pytest.raises(ResponseError) as failed:
        await call(redis, function, code, [], [])  # no key: the script fails on KEYS[1]
    assert not function_missing(failed.value)
    missing = ResponseError("Function not found")
    assert function_missing(missing) and not function_missing("Function not found")
