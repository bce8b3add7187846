"""The accounting side of the Redis event streams: the consumer group's reads, acks, dead
letters and trimming, and the drain's progress as the readers of the ledger see it (pending
entries, the live snapshot). The consumers themselves (heartbeats, take-over) are in
app/accounting/consumers.py. Key layout per app/keys.py; every key of a run shares its hash tag.
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
from app.accounting.consumers import ConsumerGroup, as_text
from app.events import StreamId

__all__ = [
    "DeadLetterRecord",
    "Entry",
    "EventStream",
    "LiveSnapshot",
    "StreamGone",
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
    when the run has none (deleted); the buffered rollouts awaiting a reward are ``unscored``,
    ``reward_leased`` of them in live reward leases. ``last_delivered`` is the consumer group's
    last delivered id, ``None`` without a group; ``last_entry`` is the stream's newest entry id,
    ``None`` when it holds none. ``length`` is the stream's length, for a stream with no group yet.

    The group's ``lag`` (``XINFO GROUPS``, Redis 7) is not read: it is derived from the group's
    ``entries-read``, which a replica that joined by full sync keeps wrong for good (Redis 7.0),
    and a failover promotes such a replica. Whether anything is undelivered is the comparison of
    the two ids instead, as ``settled.lua`` makes it.
    """

    live: int | None
    leased: int | None
    # Rollouts awaiting their reward: every one (``HLEN`` of the run's AWAITING hash), and those
    # in live reward leases (the run hash's ``rwl``); 0 when absent.
    unscored: int
    reward_leased: int
    group_pending: int | None
    last_delivered: bytes | None
    last_entry: bytes | None
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


class StreamGone(Exception):
    """A run's event stream, or its consumer group, went between the listing of the runs and a
    read (``DELETE /v1/runs/{run_id}`` unlinks the stream)."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} has no event stream or consumer group")
        self.run_id = run_id


def _gone(exc: ResponseError, streams: Mapping[str, str]) -> StreamGone | None:
    """The :class:`StreamGone` of a read's NOGROUP error, naming the run whose stream (of
    ``streams``, key -> run id) it names; None for any other error."""
    message = str(exc)
    if not message.startswith("NOGROUP"):
        return None
    for key, run_id in streams.items():
        if f"'{key}'" in message:
            return StreamGone(run_id)
    return None


def _entries(raw: Sequence[Any] | None) -> list[Entry]:
    # Redis 6.2 XAUTOCLAIM reports a deleted entry as (None, None) and keeps it pending; it is
    # acknowledged when it comes back through the consumer's own history (with no fields).
    return [Entry(id=eid, fields=fields or {}) for eid, fields in raw or () if eid is not None]


class EventStream(ConsumerGroup):
    """Redis operations of the accounting consumers, for one key prefix."""

    def __init__(self, redis: Redis, prefix: str, group: str = keys.CONSUMER_GROUP) -> None:
        super().__init__(redis, prefix, group)
        self._dead_letter = redis.register_script(_DEAD_LETTER_LUA)

    def dead_key(self, run_id: str) -> str:
        return keys.dead_key(self.prefix, run_id)

    async def run_ids(self) -> list[str]:
        """The runs the drain visits: those of the active index (app/broker/store.py). A closed
        run leaves it once its events are all drained, and comes back before it emits another."""
        raw: Any = await self.redis.zrange(keys.active_key(self.prefix), 0, -1)
        return [as_text(r) for r in raw]

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
        try:
            reply: Any = await self.redis.xreadgroup(
                self.group, consumer, {key: after}, count=count
            )
        except ResponseError as exc:
            raise _gone(exc, {key: run_id}) or exc from None
        return _entries(reply[0][1] if reply else None)

    async def claim_idle(
        self, run_id: str, consumer: str, min_idle_ms: int, start: bytes, count: int
    ) -> tuple[bytes, list[Entry], list[bytes]]:
        """XAUTOCLAIM: take over entries idle for ``min_idle_ms`` (their consumer is gone).

        Returns the next cursor, the claimed entries and (Redis 7+) ids of entries that were
        deleted meanwhile and dropped from the pending list by Redis itself.
        """
        key = self.events_key(run_id)
        try:
            reply: Any = await self.redis.xautoclaim(
                key, self.group, consumer, min_idle_ms, start, count=count
            )
        except ResponseError as exc:
            raise _gone(exc, {key: run_id}) or exc from None
        deleted = list(reply[2]) if len(reply) > 2 else []
        return reply[0], _entries(reply[1]), deleted

    async def read_new(
        self, run_ids: Sequence[str], consumer: str, count: int, block_ms: int | None
    ) -> dict[str, list[Entry]]:
        """Entries never delivered to the group, from every stream (:class:`StreamGone` for
        one that went meanwhile).

        One XREADGROUP may name streams of one cluster slot only, so on a cluster the streams
        are read with one call per slot, all sent in one pipeline (the client groups them by
        node). Only a lone call can block: with several, an empty read waits ``block_ms`` here
        instead, so an idle drain polls its streams every ``block_ms`` rather than spinning."""
        if not run_ids:
            return {}
        streams = {self.events_key(r): r for r in run_ids}
        calls = _slot_groups(self.redis, list(streams))
        try:
            replies = await self._read_new(calls, consumer, count, block_ms)
        except ResponseError as exc:
            raise _gone(exc, streams) or exc from None
        result: dict[str, list[Entry]] = {}
        for reply in replies:
            for key, raw in reply or ():
                entries = _entries(raw)
                if entries:
                    result[streams[as_text(key)]] = entries
        if not result and len(calls) > 1 and block_ms:
            await asyncio.sleep(block_ms / 1000)
        return result

    async def _read_new(
        self, calls: list[list[str]], consumer: str, count: int, block_ms: int | None
    ) -> list[Any]:
        if len(calls) == 1:
            one: Any = dict.fromkeys(calls[0], ">")
            return [
                await self.redis.xreadgroup(self.group, consumer, one, count=count, block=block_ms)
            ]
        async with self.redis.pipeline(transaction=False) as pipe:
            for group in calls:
                some: Any = dict.fromkeys(group, ">")
                pipe.xreadgroup(self.group, consumer, some, count=count)
            return list(await pipe.execute())

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

        None is undelivered when the stream's newest entry is not after the group's last
        delivered id. Otherwise the undelivered count is the stream length minus the delivered
        entries still in the stream, which trimming keeps to the pending window (the group's
        ``lag`` is not trusted: see :class:`LiveSnapshot`). Without a group yet, every entry of
        the stream is pending.
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
        ours = next((g for g in groups if as_text(g["name"]) == self.group), None)
        after = "-"
        if ours is not None:
            if int(ours["pending"]) > 0:
                summary = await self.redis.xpending(key, self.group)
                if summary["min"] is not None:
                    return StreamId.parse(summary["min"])
            after = "(" + as_text(ours["last-delivered-id"])
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
            pipe.hmget(keys.run_key(self.prefix, run_id), "live", "leased", "rwl")
            pipe.hlen(keys.run_key(self.prefix, run_id, keys.AWAITING))
            pipe.xinfo_groups(events)
            pipe.xlen(events)
            pipe.xrevrange(events, count=1)
            pipe.xlen(self.dead_key(run_id))
            replies = await pipe.execute(raise_on_error=False)
        counts, unscored, groups, length, newest, dead = replies
        live = leased = None
        reward_leased = 0
        if not isinstance(counts, Exception):
            if None not in counts[:2]:
                live, leased = int(counts[0]), int(counts[1])
            reward_leased = int(counts[2] or 0)
        ours = None
        if not isinstance(groups, Exception):
            ours = next((g for g in groups if as_text(g["name"]) == self.group), None)
        return LiveSnapshot(
            live=live,
            leased=leased,
            unscored=0 if isinstance(unscored, Exception) else int(unscored),
            reward_leased=reward_leased,
            group_pending=int(ours["pending"]) if ours is not None else None,
            last_delivered=ours["last-delivered-id"] if ours is not None else None,
            last_entry=newest[0][0] if newest and not isinstance(newest, Exception) else None,
            length=0 if isinstance(length, Exception) else int(length),
            dead_letters=0 if isinstance(dead, Exception) else int(dead),
        )

    async def pending_of(self, run_id: str, snapshot: LiveSnapshot) -> int:
        """:meth:`pending_events` as of ``snapshot``. Nothing is undelivered when the stream's
        newest entry is not after the group's last delivered id: that is decided within the
        snapshot. Otherwise the undelivered entries are counted now (:meth:`undelivered`),
        which may count entries added since, never fewer than the one the snapshot saw."""
        if snapshot.group_pending is None or snapshot.last_delivered is None:
            return snapshot.length  # no group: nothing has been read yet
        newest, delivered = snapshot.last_entry, snapshot.last_delivered
        if newest is None or not StreamId.parse(delivered) < StreamId.parse(newest):
            return snapshot.group_pending
        return snapshot.group_pending + max(1, await self.undelivered(run_id, delivered))

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
                    dead_id=as_text(dead_id),
                    stream_id=as_text(meta.get(DEAD_ID, b"")),
                    fields=original,
                    error=as_text(meta.get(DEAD_ERROR, b"")),
                    deliveries=int(meta.get(DEAD_DELIVERIES, b"0")),
                    consumer=as_text(meta.get(DEAD_CONSUMER, b"")),
                    dead_at_ms=int(meta.get(DEAD_AT, b"0")),
                )
            )
        return records
