"""A run is never without its entry in the run index, which the maintenance sweep and the
accounting drain walk: creation writes the index first, so a crash at any step leaves at most an
entry of a run that does not exist."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from app.accounting.stream import EventStream
from app.broker.config import RunConfig
from app.broker.service import Broker
from app.broker.store import Lease, RedisStore
from app.settings import Settings
from app.wiring import broker_for
from tests.broker.test_store import events, packed
from workers.drain import DrainContext, drain_once


@pytest.fixture
def broker(redis, prefix) -> Broker:
    return broker_for(redis, Settings(redis_url="redis://unused", redis_prefix=prefix))


@pytest.fixture
def drain(redis, prefix, sessionmaker) -> DrainContext:
    return DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain")


async def lease(store: RedisStore, run_id: str, size: int = 1) -> Lease | int:
    return await store.lease(
        run_id, batch_id=uuid.uuid4().hex, size=size, policy_version=None, partial=True,
        trainer_id=None,
    )  # fmt: skip


# -- item 5: no window at creation ------------------------------------------------------------
async def test_a_crash_right_after_the_create_script_leaves_a_run_that_is_swept_and_drained(
    broker, drain, redis, prefix
):
    """The window before: the create script ran, the index write after it never did; the run
    took rollouts and leases, and neither worker ever visited it."""
    store = broker.store
    real = store._scripts["create_run"]

    async def run_then_crash(*args: Any, **kw: Any) -> Any:
        await real(*args, **kw)
        raise ConnectionError("the API process died here")

    store._scripts["create_run"] = run_then_crash  # type: ignore[assignment]
    with pytest.raises(ConnectionError):
        await store.create_run("r", RunConfig(lease_timeout_s=0.05))
    store._scripts["create_run"] = real

    assert (await store.ingest("r", [packed("a")])).accepted == 1
    assert isinstance(await lease(store, "r"), Lease)
    await asyncio.sleep(0.1)
    await broker.sweep_all()
    assert "expired" in [e for e, _ in await events(store)]  # swept: its lease ran out
    await drain_once(drain)
    assert await EventStream(redis, prefix).pending_events("r") == 0  # drained


async def test_a_crash_before_the_create_script_leaves_no_run_and_the_retry_creates_it(broker):
    store = broker.store
    real = store._scripts["create_run"]

    async def crash(*args: Any, **kw: Any) -> Any:
        raise ConnectionError("the API process died here")

    store._scripts["create_run"] = crash  # type: ignore[assignment]
    with pytest.raises(ConnectionError):
        await store.create_run("r", RunConfig())
    store._scripts["create_run"] = real
    assert await store.get_run("r") is None
    assert await store.list_runs() == []  # the entry of a run that does not exist is skipped
    await broker.sweep_all()
    assert await store.create_run("r", RunConfig()) == "created"
    assert [s.run_id for s in await store.list_runs()] == ["r"]
