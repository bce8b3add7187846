"""The maintenance loop expires leases and times out groups with nobody calling the API."""

from __future__ import annotations

import asyncio
import uuid

import msgpack

from app.broker.config import RunConfig
from app.broker.store import Lease
from app.settings import Settings
from app.wiring import broker_for
from tests.broker.test_store import packed
from workers.maintenance import run_maintenance


async def _wait_for_event(store, run_id, kind, timeout_ms=10_000):
    """Block on the run's event stream until an event of this kind arrives."""
    key, last = store.events_key(run_id), "0-0"
    async with asyncio.timeout(timeout_ms / 1000):
        while True:
            for _, entries in await store.redis.xread({key: last}, block=timeout_ms):
                for eid, fields in entries:
                    last = eid
                    if fields[b"e"].decode() == kind:
                        return


async def test_the_loop_expires_leases_and_times_out_groups(redis, prefix):
    broker = broker_for(redis, Settings(redis_url="redis://unused", redis_prefix=prefix))
    store = broker.store
    await store.create_run("a", RunConfig(lease_timeout_s=0.05))
    await store.create_run("b", RunConfig(group_size=3, group_timeout_s=0.05))
    await store.ingest("a", [packed("x")])
    await store.ingest("b", [packed("y", group="g")])
    got = await store.lease(
        "a", batch_id=uuid.uuid4().hex, size=1, policy_version=None, partial=False, trainer_id=None
    )
    assert isinstance(got, Lease)

    stop = asyncio.Event()
    loop = asyncio.create_task(run_maintenance(broker, 0.02, stop))
    try:
        await _wait_for_event(store, "a", "expired")
        await _wait_for_event(store, "b", "retired")
    finally:
        stop.set()
        await loop

    retired = [
        msgpack.unpackb(f[b"d"])
        for _, f in await redis.xrange(store.events_key("b"))
        if f[b"e"] == b"retired"
    ]
    assert retired[0]["reason"] == "incomplete_group" and retired[0]["items"][0][0] == "y"
    # the expired rollout is back, unused
    again = await store.lease(
        "a", batch_id=uuid.uuid4().hex, size=1, policy_version=None, partial=False, trainer_id=None
    )
    assert isinstance(again, Lease) and again.rollouts[0].uses == 0
