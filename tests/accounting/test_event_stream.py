"""``EventStream.oldest_undrained``: the event whose age is the drain's delay (GET /metrics),
on a stream written with known ids."""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from app.accounting.stream import EventStream
from app.events import StreamId


async def test_the_oldest_undrained_event_is_the_oldest_pending_then_the_first_undelivered(
    redis, prefix, run_id
):
    stream = EventStream(redis, prefix)
    key = stream.events_key(run_id)
    assert await stream.oldest_undrained(run_id) is None  # nothing written

    for ms in (1000, 2000, 3000):
        await redis.xadd(key, {"e": "x"}, id=f"{ms}-0")
    # No group yet: nothing was read, the stream's first entry is the oldest.
    assert await stream.oldest_undrained(run_id) == StreamId(1000, 0)

    await stream.ensure_group(run_id)
    await redis.xreadgroup(stream.group, "drain-a", {key: ">"}, count=2)
    assert await stream.oldest_undrained(run_id) == StreamId(1000, 0)  # pending, oldest first
    await stream.ack(run_id, [b"1000-0"])
    assert await stream.oldest_undrained(run_id) == StreamId(2000, 0)  # still pending
    await stream.ack(run_id, [b"2000-0"])
    assert await stream.oldest_undrained(run_id) == StreamId(3000, 0)  # never delivered
    await redis.xreadgroup(stream.group, "drain-a", {key: ">"})
    await stream.ack(run_id, [b"3000-0"])
    assert await stream.oldest_undrained(run_id) is None  # all drained


async def _miscount_entries_read(redis, key: str, group: str, entries_read: int) -> None:
    """Give the group a wrong ``entries-read``, as a Redis 7.0 replica that joined by full sync
    keeps it (issue 31, finding 3): ``XINFO GROUPS`` then reports a wrong ``lag`` for good."""
    info = next(g for g in await redis.xinfo_groups(key) if g["name"].decode() == group)
    try:
        await redis.xgroup_setid(key, group, info["last-delivered-id"], entries_read=entries_read)
    except ResponseError as exc:  # Redis 6.2 has neither ENTRIESREAD nor a lag to mislead
        pytest.skip(f"no XGROUP SETID ... ENTRIESREAD: {exc}")


async def test_pending_events_do_not_trust_the_groups_lag(redis, prefix, run_id):
    stream = EventStream(redis, prefix)
    key = stream.events_key(run_id)
    for ms in (1000, 2000, 3000):
        await redis.xadd(key, {"e": "x"}, id=f"{ms}-0")
    await stream.ensure_group(run_id)
    await redis.xreadgroup(stream.group, "drain-a", {key: ">"})
    await stream.ack(run_id, [b"1000-0", b"2000-0", b"3000-0"])
    assert await stream.pending_events(run_id) == 0

    # Too few entries read: the lag says 2 where nothing is left, and stays so after reads.
    await _miscount_entries_read(redis, key, stream.group, 1)
    assert (await redis.xinfo_groups(key))[0]["lag"] == 2
    assert await stream.pending_events(run_id) == 0
    await redis.xadd(key, {"e": "x"}, id="4000-0")
    assert await stream.pending_events(run_id) == 1
    await redis.xreadgroup(stream.group, "drain-a", {key: ">"})
    assert await stream.pending_events(run_id) == 1  # delivered, not yet acknowledged
    await stream.ack(run_id, [b"4000-0"])
    assert (await redis.xinfo_groups(key))[0]["lag"] == 2
    assert await stream.pending_events(run_id) == 0

    # Too many: the lag says none (or fewer than none) where entries wait.
    for ms in (5000, 6000):
        await redis.xadd(key, {"e": "x"}, id=f"{ms}-0")
    await _miscount_entries_read(redis, key, stream.group, 9)
    assert (await redis.xinfo_groups(key))[0]["lag"] <= 0
    assert await stream.pending_events(run_id) == 2
    await redis.xreadgroup(stream.group, "drain-a", {key: ">"}, count=1)
    assert await stream.pending_events(run_id) == 2  # one pending, one undelivered
