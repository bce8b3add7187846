"""``EventStream.oldest_undrained``: the event whose age is the drain's delay (GET /metrics),
on a stream written with known ids."""

from __future__ import annotations

from accounting_helpers import miscount_entries_read

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
    await miscount_entries_read(redis, key, stream.group, 1)
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
    await miscount_entries_read(redis, key, stream.group, 9)
    assert (await redis.xinfo_groups(key))[0]["lag"] <= 0
    assert await stream.pending_events(run_id) == 2
    await redis.xreadgroup(stream.group, "drain-a", {key: ">"}, count=1)
    assert await stream.pending_events(run_id) == 2  # one pending, one undelivered
