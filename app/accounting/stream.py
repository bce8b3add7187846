"""The accounting side of the Redis event streams: the consumer group, reads, acks, dead
letters and trimming. Key layout per app/keys.py; every key of a run shares its hash tag.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ResponseError

from app import keys
from app.events import StreamId

__all__ = [
    "DeadLetterRecord",
    "Entry",
    "EventStream",
    "LiveSnapshot",
]

# Dead-letter entries keep the original fields verbatim and add these.
DEAD_ID = b"dead.id"
DEAD_ERROR = b"dead.error"
DEAD_DELIVERIES = b"dead.deliveries"
DEAD_CONSUMER = b"dead.consumer"
DEAD_AT = b"dead.at"

_MAX_ERROR_BYTES = 2000

# Acknowledge and dead-letter in one step: only the call whose XACK removed the entry from
# the pending list writes the dead letter, so two consumers that both gave up on the same
# entry (one claimed it from the other) leave one dead letter, and a crash leaves none or one.
_DEAD_LETTER_LUA = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
end
return false
"""


# Every drain consumer's last heartbeat, by the Redis server's clock (see the scripts below).
_BEAT_LUA = """
redis.replicate_commands()  -- TIME before a write (a no-op on Redis >= 7)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
return now
"""

# The consumers whose last heartbeat is older than ARGV[1] ms (at most ARGV[2] of them). Their
# score is moved to now, so that for the next ARGV[1] ms no other caller takes them: the one
# that got them takes over their pending entries, then forgets them (_FORGET_LUA).
_SILENT_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local silent = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]),
  'LIMIT', 0, tonumber(ARGV[2]))
for _, name in ipairs(silent) do
  redis.call('ZADD', KEYS[1], now, name)
end
return {now, silent}
"""

# Forget a consumer that was taken over, unless it has sent a heartbeat since (it was alive).
_FORGET_LUA = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
"""

# Delete a consumer from a stream's group only while it holds no pending entry: checked and
# done in one step, so an entry delivered to it meanwhile is never dropped from the group's
# pending list (DELCONSUMER forgets whatever the consumer still holds). A consumer that is
# alive after all is created again by its next read. 1: deleted, 0: not in the group, -1: it
# holds entries.
_DELETE_IDLE_CONSUMER_LUA = """
for _, row in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local c = {}
  for i = 1, #row, 2 do c[row[i]] = row[i + 1] end
  if c['name'] == ARGV[2] then
    if tonumber(c['pending']) > 0 then return -1 end
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    return 1
  end
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Entry:
    """A delivered stream entry; ``fields`` is empty when the entry was deleted meanwhile."""

    id: bytes
    fields: Mapping[bytes, bytes]


@dataclass(frozen=True, slots=True)
class DeadLetterRecord:
    dead_id: str
    stream_id: str
    fields: dict[bytes, bytes]
    error: str
    deliveries: int
    consumer: str
    dead_at_ms: int


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    """The broker's live counts of a run and the drain's progress on its stream, read from
    Redis in one MULTI, so that they describe one moment.

    ``live`` and ``leased`` are the run hash's counts (buffered + leased, and leased), ``None``
    when the run has none (deleted). ``last_delivered`` is the consumer group's last delivered
    id, ``None`` without a group; ``lag`` is the group's undelivered count where Redis reports
    it (7+). ``length`` is the stream's length, for a stream with no group yet.
    """

    live: int | None
    leased: int | None
    group_pending: int | None
    lag: int | None
    last_delivered: bytes | None
    length: int
    dead_letters: int

    @property
    def buffered(self) -> int | None:
        if self.live is None or self.leased is None:
            return None
        return self.live - self.leased


def _slot_groups(redis: Redis, names: list[str]) -> list[list[str]]:
    """The keys in groups one command may name together: all of them on one Redis node, the
    keys of each slot on a cluster."""
    if not isinstance(redis, RedisCluster):
        return [names]
    slots: dict[int, list[str]] = {}
    for name in names:
        slots.setdefault(key_slot(name.encode()), []).append(name)
    return list(slots.values())


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _entries(raw: Sequence[Any] | None) -> list[Entry]:
    # Redis 6.2 XAUTOCLAIM reports a deleted entry as (None, None) and keeps it pending; it is
    # acknowledged when it comes back through the consumer's own history (with no fields).
    return [Entry(id=eid, fields=fields or {}) for eid, fields in raw or () if eid is not None]


class EventStream:
    """Redis operations of the accounting consumers, for one key prefix."""

    def __init__(self, redis: Redis, prefix: str, group: str = keys.CONSUMER_GROUP) -> None:
        self.redis = redis
        self.prefix = prefix
        self.group = group
        self._dead_letter = redis.register_script(_DEAD_LETTER_LUA)
        self._beat = redis.register_script(_BEAT_LUA)
        self._silent = redis.register_script(_SILENT_LUA)
        self._forget = redis.register_script(_FORGET_LUA)
        self._delete_idle_consumer = redis.register_script(_DELETE_IDLE_CONSUMER_LUA)

    @property
    def consumers_key(self) -> str:
        return keys.drain_consumers_key(self.prefix)

    def events_key(self, run_id: str) -> str:
        return keys.events_key(self.prefix, run_id)

    def dead_key(self, run_id: str) -> str:
        return keys.dead_key(self.prefix, run_id)

    async def run_ids(self) -> list[str]:
        """The runs the drain visits: those of the active index (app/broker/store.py). A closed
        run leaves it once its events are all drained, and comes back before it emits another."""
        raw: Any = await self.redis.zrange(keys.active_key(self.prefix), 0, -1)
        return [_text(r) for r in raw]

    async def run_exists(self, run_id: str) -> bool:
        return bool(await self.redis.exists(keys.run_key(self.prefix, run_id)))

    async def ensure_group(self, run_id: str) -> bool:
        """Create the group at the stream's start; False while the stream does not exist."""
        try:
            await self.redis.xgroup_create(self.events_key(run_id), self.group, id="0")
        except ResponseError as exc:
            message = str(exc)
            if "BUSYGROUP" in message:
                return True
            if "requires the key to exist" in message:
                return False
            raise
        return True

    async def read_own_pending(
        self, run_id: str, consumer: str, after: bytes, count: int
    ) -> list[Entry]:
        """This consumer's delivered-but-unacknowledged entries with ids above ``after``."""
        key = self.events_key(run_id)
        reply: Any = await self.redis.xreadgroup(self.group, consumer, {key: after}, count=count)
        return _entries(reply[0][1] if reply else None)

    async def claim_idle(
        self, run_id: str, consumer: str, min_idle_ms: int, start: bytes, count: int
    ) -> tuple[bytes, list[Entry], list[bytes]]:
        """XAUTOCLAIM: take over entries idle for ``min_idle_ms`` (their consumer is gone).

        Returns the next cursor, the claimed entries and (Redis 7+) ids of entries that were
        deleted meanwhile and dropped from the pending list by Redis itself.
        """
        reply: Any = await self.redis.xautoclaim(
            self.events_key(run_id), self.group, consumer, min_idle_ms, start, count=count
        )
        deleted = list(reply[2]) if len(reply) > 2 else []
        return reply[0], _entries(reply[1]), deleted

    async def read_new(
        self, run_ids: Sequence[str], consumer: str, count: int, block_ms: int | None
    ) -> dict[str, list[Entry]]:
        """Entries never delivered to the group, from every stream.

        One XREADGROUP may name streams of one cluster slot only, so on a cluster the streams
        are read with one call per slot, all sent in one pipeline (the client groups them by
        node). Only a lone call can block: with several, an empty read waits ``block_ms`` here
        instead, so an idle drain polls its streams every ``block_ms`` rather than spinning."""
        if not run_ids:
            return {}
        streams = {self.events_key(r): r for r in run_ids}
        calls = _slot_groups(self.redis, list(streams))
        replies: list[Any]
        if len(calls) == 1:
            one: Any = dict.fromkeys(calls[0], ">")
            replies = [
                await self.redis.xreadgroup(self.group, consumer, one, count=count, block=block_ms)
            ]
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for group in calls:
                    some: Any = dict.fromkeys(group, ">")
                    pipe.xreadgroup(self.group, consumer, some, count=count)
                replies = await pipe.execute()
        result: dict[str, list[Entry]] = {}
        for reply in replies:
            for key, raw in reply or ():
                entries = _entries(raw)
                if entries:
                    result[streams[_text(key)]] = entries
        if not result and len(calls) > 1 and block_ms:
            await asyncio.sleep(block_ms / 1000)
        return result

    async def delivery_counts(self, run_id: str, ids: Sequence[bytes]) -> dict[bytes, int]:
        """How often each still-pending entry has been delivered (XPENDING)."""
        key = self.events_key(run_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.xpending_range(key, self.group, min=entry_id, max=entry_id, count=1)
            replies = await pipe.execute()
        counts: dict[bytes, int] = {}
        for reply in replies:
            for row in reply:
                counts[row["message_id"]] = int(row["times_delivered"])
        return counts

    async def ack(self, run_id: str, ids: Sequence[bytes]) -> int:
        if not ids:
            return 0
        return int(await self.redis.xack(self.events_key(run_id), self.group, *ids))

    async def dead_letter(
        self, run_id: str, entry: Entry, *, error: str, deliveries: int, consumer: str
    ) -> bool:
        """Move an entry that cannot be applied to the run's dead-letter stream and ack it."""
        fields: dict[bytes, bytes] = dict(entry.fields)
        fields.update(
            {
                DEAD_ID: entry.id,
                DEAD_ERROR: error.encode("utf-8", "replace")[:_MAX_ERROR_BYTES],
                DEAD_DELIVERIES: str(deliveries).encode(),
                DEAD_CONSUMER: consumer.encode(),
                DEAD_AT: str(int(time.time() * 1000)).encode(),
            }
        )
        args: list[bytes | str] = [self.group, entry.id]
        for name, value in fields.items():
            args.extend((name, value))
        written = await self._dead_letter(
            keys=[self.events_key(run_id), self.dead_key(run_id)], args=args
        )
        return written is not None

    async def trim_acknowledged(self, run_id: str) -> int:
        """Delete the entries every group has acknowledged (``XTRIM MINID``).

        The bound is the oldest pending entry of any group, or the entry after the last one
        delivered when nothing is pending, so neither pending nor undelivered entries go.
        XINFO GROUPS is read before XPENDING: entries delivered in between have ids above the
        last-delivered id seen, so they stay above the bound.
        """
        key = self.events_key(run_id)
        try:
            groups = await self.redis.xinfo_groups(key)
        except ResponseError:
            return 0  # no such stream
        bound: StreamId | None = None
        for group in groups:
            candidate = StreamId.parse(group["last-delivered-id"]).next()
            if int(group["pending"]) > 0:
                summary = await self.redis.xpending(key, group["name"])
                if summary["min"] is not None:
                    candidate = min(candidate, StreamId.parse(summary["min"]))
            bound = candidate if bound is None else min(bound, candidate)
        if bound is None:
            return 0  # no consumer group yet: nothing has been read, nothing may go
        return int(await self.redis.xtrim(key, minid=str(bound), approximate=False))

    async def pending_events(self, run_id: str) -> int:
        """Entries not yet drained: the group's pending entries plus those never delivered.

        Redis 7 reports the undelivered count as the group's ``lag``. Where it is missing or
        unknown (Redis 6.2, or after deletions) it is the stream length minus the delivered
        entries still in the stream, which trimming keeps to the pending window. Without a
        group yet, every entry of the stream is pending.
        """
        return await self.pending_of(run_id, await self.live_snapshot(run_id))

    async def oldest_undrained(self, run_id: str) -> StreamId | None:
        """The id of the run's oldest event not yet drained (its ``ms`` is when it was
        written), or None when nothing is pending: the group's oldest pending entry, else the
        first entry it has not been delivered, else (no group yet) the stream's first."""
        key = self.events_key(run_id)
        try:
            groups: Any = await self.redis.xinfo_groups(key)
        except ResponseError:  # no stream: nothing was written
            return None
        ours = next((g for g in groups if _text(g["name"]) == self.group), None)
        after = "-"
        if ours is not None:
            if int(ours["pending"]) > 0:
                summary = await self.redis.xpending(key, self.group)
                if summary["min"] is not None:
                    return StreamId.parse(summary["min"])
            after = "(" + _text(ours["last-delivered-id"])
        first: Any = await self.redis.xrange(key, min=after, count=1)
        return StreamId.parse(first[0][0]) if first else None

    async def undelivered(self, run_id: str, last_delivered: bytes) -> int:
        """Entries after ``last_delivered``, counted from the (short) delivered side."""
        key = self.events_key(run_id)
        length = int(await self.redis.xlen(key))
        delivered = 0
        cursor: bytes | str = "-"
        while True:
            page: Any = await self.redis.xrange(key, min=cursor, max=last_delivered, count=1000)
            delivered += len(page)
            if len(page) < 1000:
                break
            cursor = b"(" + page[-1][0]
        # A trim between the two reads shrinks the delivered side: never report below zero.
        return max(0, length - delivered)

    async def live_snapshot(self, run_id: str) -> LiveSnapshot:
        """The run's live counts, its dead letters and the group's progress, in one MULTI (every
        key shares the run's hash tag). A missing or malformed key reads as absent."""
        events = self.events_key(run_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hmget(keys.run_key(self.prefix, run_id), "live", "leased")
            pipe.xinfo_groups(events)
            pipe.xlen(events)
            pipe.xlen(self.dead_key(run_id))
            counts, groups, length, dead = await pipe.execute(raise_on_error=False)
        live = leased = None
        if not isinstance(counts, Exception) and None not in counts:
            live, leased = int(counts[0]), int(counts[1])
        ours = None
        if not isinstance(groups, Exception):
            ours = next((g for g in groups if _text(g["name"]) == self.group), None)
        lag = ours.get("lag") if ours is not None else None
        return LiveSnapshot(
            live=live,
            leased=leased,
            group_pending=int(ours["pending"]) if ours is not None else None,
            lag=int(lag) if lag is not None else None,
            last_delivered=ours["last-delivered-id"] if ours is not None else None,
            length=0 if isinstance(length, Exception) else int(length),
            dead_letters=0 if isinstance(dead, Exception) else int(dead),
        )

    async def pending_of(self, run_id: str, snapshot: LiveSnapshot) -> int:
        """:meth:`pending_events` as of ``snapshot``. Where Redis does not report the lag, the
        undelivered entries are counted now, which may count entries added since: never
        fewer."""
        if snapshot.group_pending is None or snapshot.last_delivered is None:
            return snapshot.length  # no group: nothing has been read yet
        lag = snapshot.lag
        if lag is None:
            lag = await self.undelivered(run_id, snapshot.last_delivered)
        return snapshot.group_pending + lag

    # -- consumers: heartbeats, taking over the silent ones, deleting the gone ones ---------

    async def beat(self, consumer: str) -> None:
        """Record that ``consumer`` is alive now."""
        await self._beat(keys=[self.consumers_key], args=[consumer])

    async def take_silent(self, silent_ms: int, limit: int) -> tuple[int, list[str]]:
        """Consumers with no heartbeat for ``silent_ms``, now this caller's to take over for the
        next ``silent_ms``; and the mark to :meth:`forget` them by."""
        mark, names = await self._silent(keys=[self.consumers_key], args=[silent_ms, limit])
        return int(mark), [_text(n) for n in names]

    async def forget(self, consumer: str, mark: int) -> bool:
        """Drop a taken-over consumer from the heartbeats, unless it has beaten since."""
        return bool(await self._forget(keys=[self.consumers_key], args=[consumer, mark]))

    async def leave(self, consumer: str) -> None:
        await self.redis.zrem(self.consumers_key, consumer)

    async def beating(self, within_ms: int) -> set[str]:
        """Consumers whose last heartbeat is at most ``within_ms`` old."""
        seconds, micros = await self.redis.time()
        now = seconds * 1000 + micros // 1000
        raw: Any = await self.redis.zrangebyscore(self.consumers_key, now - within_ms, "+inf")
        return {_text(r) for r in raw}

    async def claim_all(self, run_id: str, owner: str, consumer: str, count: int) -> int:
        """Move every pending entry of ``owner`` to ``consumer`` (XCLAIM JUSTID: neither read
        nor counted as a delivery; the new owner reads them as its own pending entries)."""
        key = self.events_key(run_id)
        claimed = 0
        while True:
            try:
                rows: Any = await self.redis.xpending_range(
                    key, self.group, "-", "+", count, consumername=owner
                )
            except ResponseError:
                return claimed  # no stream or no group
            ids = [row["message_id"] for row in rows]
            if ids:
                got: Any = await self.redis.xclaim(key, self.group, consumer, 0, ids, justid=True)
                claimed += len(got)
            if len(ids) < count:
                return claimed

    async def consumers(self, run_id: str) -> list[tuple[str, int, int]]:
        """(name, pending entries, idle ms) of each consumer of the group (XINFO CONSUMERS)."""
        try:
            rows: Any = await self.redis.xinfo_consumers(self.events_key(run_id), self.group)
        except ResponseError:
            return []
        return [(_text(r["name"]), int(r["pending"]), int(r["idle"])) for r in rows]

    async def delete_consumer(self, run_id: str, consumer: str) -> int:
        """Delete ``consumer`` from the run's group unless it holds pending entries: 1 when it
        was deleted, 0 when it was not in the group (or there is no group), -1 when it holds
        entries (and stays)."""
        try:
            return int(
                await self._delete_idle_consumer(
                    keys=[self.events_key(run_id)], args=[self.group, consumer]
                )
            )
        except ResponseError:
            return 0  # no stream or no group

    async def dead_letter_count(self, run_id: str) -> int:
        return int(await self.redis.xlen(self.dead_key(run_id)))

    async def dead_letters(
        self, run_id: str, *, after: str | None, count: int
    ) -> list[DeadLetterRecord]:
        start = "-" if after is None else f"({after}"
        page: Any = await self.redis.xrange(self.dead_key(run_id), min=start, max="+", count=count)
        records = []
        for dead_id, raw in page:
            meta = dict(raw)
            original = {k: v for k, v in meta.items() if not k.startswith(b"dead.")}
            records.append(
                DeadLetterRecord(
                    dead_id=_text(dead_id),
                    stream_id=_text(meta.get(DEAD_ID, b"")),
                    fields=original,
                    error=_text(meta.get(DEAD_ERROR, b"")),
                    deliveries=int(meta.get(DEAD_DELIVERIES, b"0")),
                    consumer=_text(meta.get(DEAD_CONSUMER, b"")),
                    dead_at_ms=int(meta.get(DEAD_AT, b"0")),
                )
            )
        return records
