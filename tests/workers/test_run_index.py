"""The run indexes and what the workers visit.

A run is never without its entry in the active index, the index the maintenance sweep and the
accounting drain walk: creation writes the indexes first, so a crash at any step leaves at most
entries of a run that does not exist. A closed run that has settled (nothing live, every event
drained) is parked and leaves the index, so a worker pass costs nothing for it; any call that
would change it takes it back in first.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio.connection import AbstractConnection

from app import keys
from app.accounting.stream import EventStream
from app.broker.config import RunConfig
from app.broker.service import Broker
from app.broker.store import Lease, RedisStore, StoreError
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


async def active(store: RedisStore) -> set[str]:
    return {rid for rid, _ in await store.active_runs()}


async def settle(broker: Broker, drain: DrainContext, passes: int = 6) -> None:
    """Worker passes, as the worker process alternates them, until the index stops changing."""
    before: set[str] | None = None
    for _ in range(passes):
        await broker.sweep_all()
        await drain_once(drain)
        now = await active(broker.store)
        if now == before:
            return
        before = now


class Commands:
    """Every command the test process sends to Redis (pipelines and scripts included)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes | str, ...]] = []

    def touching(self, run_id: str) -> list[tuple[bytes | str, ...]]:
        tag = keys.run_tag("", run_id)[1:]  # '{<run_id>}', in every key of the run
        return [c for c in self.sent if any(tag in _text(a) for a in c)]


def _text(arg: Any) -> str:
    if isinstance(arg, bytes | bytearray | memoryview):
        return bytes(arg).decode("utf-8", "replace")
    return str(arg)


@pytest.fixture
def commands(monkeypatch) -> Iterator[Commands]:
    rec = Commands()
    real = AbstractConnection.pack_command

    def pack(self: AbstractConnection, *args: Any) -> Any:
        rec.sent.append(args)
        return real(self, *args)

    monkeypatch.setattr(AbstractConnection, "pack_command", pack)
    yield rec


# -- item 5: no window at creation ------------------------------------------------------------
async def test_a_crash_right_after_the_create_script_leaves_a_run_that_is_swept_and_drained(
    broker, drain, redis, prefix
):
    """The window before: the create script ran, the index write after it never did; the run
    took rollouts and leases, and neither worker ever visited it."""
    store = broker.store
    real = store._script

    async def run_then_crash(name: str, *args: Any) -> Any:
        reply = await real(name, *args)
        if name == "create_run":
            raise ConnectionError("the API process died here")
        return reply

    store._script = run_then_crash  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await store.create_run("r", RunConfig(lease_timeout_s=0.05))
    del store._script  # the class's own again

    assert (await store.ingest("r", [packed("a")])).accepted == 1
    assert isinstance(await lease(store, "r"), Lease)
    await asyncio.sleep(0.1)
    await broker.sweep_all()
    assert "expired" in [e for e, _ in await events(store)]  # swept: its lease ran out
    await drain_once(drain)
    assert await EventStream(redis, prefix).pending_events("r") == 0  # drained


@pytest.mark.parametrize("crash_after", ["run index", "active index", "create script"])
async def test_a_crash_at_any_step_of_creation_leaves_no_run_outside_the_active_index(
    broker, drain, crash_after, monkeypatch
):
    store = broker.store
    died = ConnectionError("the API process died here")
    real_activate, real_script = store.activate, store._script

    async def activate_then_die(run_id: str, floor: int = 0) -> int:
        if crash_after == "run index":
            raise died
        await real_activate(run_id, floor)
        raise died

    async def script_then_die(name: str, *args: Any) -> Any:
        reply = await real_script(name, *args)
        if name == "create_run":
            raise died
        return reply

    if crash_after == "create script":
        monkeypatch.setattr(store, "_script", script_then_die)
    else:
        monkeypatch.setattr(store, "activate", activate_then_die)
    with pytest.raises(ConnectionError):
        await store.create_run("r", RunConfig())
    monkeypatch.undo()

    exists = await store.get_run("r") is not None
    assert exists == (crash_after == "create script")
    assert not exists or "r" in await active(store)
    # Entries of a run that does not exist are skipped, and cost a pass nothing that fails.
    assert [s.run_id for s in (await store.list_runs()).runs] == (["r"] if exists else [])
    await settle(broker, drain)
    # The client's retry (POST /v1/runs is idempotent) finishes the job.
    assert await store.create_run("r", RunConfig()) == ("exists" if exists else "created")
    assert "r" in await active(store)
    assert [s.run_id for s in (await store.list_runs()).runs] == ["r"]


async def test_an_entry_of_a_run_never_created_is_cleared_after_the_grace(broker, monkeypatch):
    store = broker.store
    await store.activate("ghost")
    await broker.sweep_all()
    assert await active(store) == {"ghost"}  # may be a creation under way
    monkeypatch.setattr("app.broker.service.ORPHAN_GRACE_MS", -1)
    await broker.sweep_all()
    assert await active(store) == set()


# -- item 7: closed runs cost the workers nothing ---------------------------------------------
async def test_a_worker_pass_touches_only_the_open_runs(broker, drain, commands):
    store = broker.store
    runs = [f"run-{i}" for i in range(30)]
    for rid in runs:
        await store.create_run(rid, RunConfig())
        await store.ingest(rid, [packed(f"{rid}-x")])
    opened, closed = runs[:3], runs[3:]
    for rid in closed:
        await store.close_run(rid)
    await settle(broker, drain)
    assert await active(store) == set(opened)

    commands.sent.clear()
    await broker.sweep_all()
    await drain_once(drain, claim=True)
    assert [rid for rid in closed if commands.touching(rid)] == []
    assert all(commands.touching(rid) for rid in opened)
    # Scripts on a run's keys (the drain's heartbeat, on a key of no run, may fall in the pass).
    scripts = [
        c
        for c in commands.sent
        if _text(c[0]).upper() in ("FCALL", "EVALSHA", "EVAL") and "{" in _text(c[3])
    ]
    assert len(scripts) == len(opened)  # one maintenance call per open run


async def test_a_closed_run_leaves_the_index_once_its_leases_end_and_its_events_are_drained(
    broker, drain
):
    store = broker.store
    await store.create_run("r", RunConfig(lease_timeout_s=60))
    await store.ingest("r", [packed("a"), packed("b")])
    got = await lease(store, "r")
    assert isinstance(got, Lease)
    await store.close_run("r")
    await settle(broker, drain)
    assert await active(store) == {"r"}  # a lease is still out
    await store.nack("r", got.batch_id)
    await broker.sweep_all()
    assert await active(store) == {"r"}  # the nack's events are not drained yet
    await drain_once(drain)
    await broker.sweep_all()
    assert await active(store) == set()
    assert (await store.get_run("r")).status == "closed"  # type: ignore[union-attr]


async def test_a_call_on_a_parked_run_takes_it_back_into_the_index_first(broker, drain, redis):
    store = broker.store
    await store.create_run("r", RunConfig())
    await store.close_run("r")
    await settle(broker, drain)
    assert await active(store) == set()

    out = await store.ingest("r", [packed("late")])  # its rejection is an event to drain
    assert out.rejected == [("late", "run_closed")]
    assert await active(store) == {"r"}
    assert await redis.hget(store.run_key("r"), "parked") is None
    assert await store.set_policy("r", 2) == (2, 0)
    await settle(broker, drain)
    assert await active(store) == set()
    assert await EventStream(redis, store.prefix).pending_events("r") == 0
    # Closing or reading it again leaves it parked.
    await store.close_run("r")
    assert await store.get_run("r") is not None
    assert await redis.hget(store.run_key("r"), "parked") == b"1"


async def test_a_wake_up_after_the_worker_read_the_index_keeps_the_run_in(broker, drain, redis):
    """The worker parks a run at the token it read and takes it out only at that token; a call
    that woke the run in between raised the token, so the run stays in the index."""
    store = broker.store
    await store.create_run("r", RunConfig())
    await store.close_run("r")
    await drain_once(drain)
    [(_, token)] = await store.active_runs()
    assert (await store.maintain("r", token)).state == "parked"
    await store.ingest("r", [packed("late")])  # wakes it: a new token, then unparked
    assert not await store.deactivate("r", token)
    assert await active(store) == {"r"}
    assert await redis.hget(store.run_key("r"), "parked") is None


async def test_a_wake_up_that_died_half_way_is_parked_again(broker, drain, redis):
    store = broker.store
    await store.create_run("r", RunConfig())
    await store.close_run("r")
    await settle(broker, drain)
    held = int(await redis.hget(store.run_key("r"), "tok"))
    await store.activate("r", held + 1)  # the index write of a wake-up, and no more
    await broker.sweep_all()
    assert await active(store) == set()
    assert await store.ingest("r", [packed("late")])  # a later wake-up is not stale
    assert await active(store) == {"r"}


async def test_deleting_a_parked_run_wakes_it_to_count_what_its_consumers_held(broker, drain):
    """The drop of what consumers hold is an event the accounting must apply before the run
    goes, and the drain serves only runs in the index: a parked run is woken for it."""
    store = broker.store
    await store.create_run("r", RunConfig())
    await store.create_consumer("r", "c", source="received")
    await store.ingest("r", [packed("a"), packed("b")])
    await store.close_run("r")
    await settle(broker, drain)
    assert await active(store) == set()  # parked, with c holding a and b
    with pytest.raises(StoreError) as busy:
        await store.delete_run("r")
    assert busy.value.code == "run_busy"
    assert await active(store) == {"r"}  # woken: the drain applies the drop
    await settle(broker, drain)
    await store.delete_run("r")
    assert await store.get_run("r") is None
