"""An operator action on a run and its audit entry are one: the script that changes the run
writes the entry to the run's outbox in the same call (lua/lib/audit.lua), before anything
moves it on; a refused action, or one that changes nothing, writes none."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from app import keys
from app.broker.config import RunConfig
from app.broker.store import RedisStore, StoreError
from app.caller import action_entry
from tests.helpers import OPS


def entry(action: str, **detail: Any) -> bytes:
    return action_entry(OPS, action, "r", detail)


async def outbox(redis: Redis, prefix: str, run_id: str = "r") -> list[tuple[int, bytes]]:
    """(the stream id's milliseconds, field ``e``) of every entry of the run's outbox."""
    got = await redis.xrange(keys.outbox_key(prefix, run_id))
    return [(int(sid.decode().partition("-")[0]), fields[b"e"]) for sid, fields in got]


async def settle(redis: Redis, prefix: str, run_id: str = "r") -> None:
    """Mark the run's events applied, as the accounting drain would (a delete waits for it)."""
    await redis.xgroup_create(keys.events_key(prefix, run_id), keys.CONSUMER_GROUP, id="$")


async def test_each_action_writes_its_entry_in_the_call_that_changes_the_run(
    store: RedisStore, redis: Redis, prefix: str
) -> None:
    config = RunConfig()
    made = [
        entry("run.create", config=config.model_dump(mode="json")),
        entry("run.config", patch={"max_reuse": 2}),
        entry("run.policy", version=3),
        entry("run.close"),
        entry("run.delete"),
    ]
    start = int(time.time() * 1000)
    assert await store.create_run("r", config, entry=made[0]) == "created"
    assert [e for _, e in await outbox(redis, prefix)] == made[:1]  # nothing has moved it
    new = RunConfig(max_reuse=2)
    assert await store.replace_config("r", config.canonical_json(), new, entry=made[1]) == (
        "replaced"
    )
    await store.set_policy("r", 3, entry=made[2])
    await store.close_run("r", entry=made[3])
    assert [e for _, e in await outbox(redis, prefix)] == made[:4]
    await settle(redis, prefix)
    await store.delete_run("r", entry=made[4])
    got = await outbox(redis, prefix)
    assert [e for _, e in got] == made  # the delete keeps the outbox, and adds its entry
    assert await redis.hget(keys.run_key(prefix, "r"), "st") == b"deleted"
    # The stream id is the entry's time.
    assert start <= got[0][0] <= got[-1][0] <= int(time.time() * 1000)
    assert orjson.loads(got[2][1]) == {
        "actor": "ops",
        "token_id": "t-ops",
        "action": "run.policy",
        "run_id": "r",
        "detail": {"version": 3},
    }


async def test_a_refused_action_writes_no_entry(store: RedisStore, redis: Redis, prefix: str):
    config = RunConfig()
    await store.create_run("r", config)
    await store.set_policy("r", 2)
    refused = [
        lambda: store.create_run("r", RunConfig(max_reuse=5), entry=entry("run.create")),
        lambda: store.set_policy("r", 1, entry=entry("run.policy", version=1)),
        lambda: store.delete_run("r", entry=entry("run.delete")),  # open
        lambda: store.close_run("nope", entry=entry("run.close")),
        lambda: store.replace_config(
            "nope", config.canonical_json(), config, entry=entry("run.config")
        ),
    ]
    for call in refused:
        with pytest.raises(StoreError):
            await call()
    assert await outbox(redis, prefix) == []
    assert await outbox(redis, prefix, "nope") == []


async def test_an_action_that_changes_nothing_writes_no_entry(
    store: RedisStore, redis: Redis, prefix: str
) -> None:
    config = RunConfig()
    await store.create_run("r", config)
    await store.set_policy("r", 2)
    await store.close_run("r")
    await settle(redis, prefix)
    unchanged = [
        store.create_run("r", config, entry=entry("run.create")),  # exists
        store.set_policy("r", 2, entry=entry("run.policy", version=2)),  # the current version
        store.close_run("r", entry=entry("run.close")),  # closed already
        store.replace_config(  # the same config again
            "r", config.canonical_json(), config, entry=entry("run.config", patch={})
        ),
    ]
    for call in unchanged:
        await call
    assert await outbox(redis, prefix) == []
    await store.delete_run("r", entry=entry("run.delete"))
    await store.delete_run("r", entry=entry("run.delete"))  # deleted already
    assert [e for _, e in await outbox(redis, prefix)] == [entry("run.delete")]
