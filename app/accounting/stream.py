"""The accounting side of the Redis event streams: the consumer group, reads, acks, dead
letters and trimming. Key layout per app/broker/keys.py; every key of a run shares its hash tag.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from app.accounting.events import StreamId
from app.broker import keys

__all__ = [
    "CONSUMER_GROUP",
    "DeadLetterRecord",
    "Entry",
    "EventStream",
    "dead_key",
    "events_key",
    "run_key",
    "runs_key",
]

CONSUMER_GROUP = "accounting"

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


# The key layout is app/broker/keys.py's; these names stay for the accounting's callers.
def runs_key(prefix: str) -> str:
    return keys.runs_key(prefix)


def events_key(prefix: str, run_id: str) -> str:
    return keys.events_key(prefix, run_id)


def dead_key(prefix: str, run_id: str) -> str:
    return keys.dead_key(prefix, run_id)


def run_key(prefix: str, run_id: str) -> str:
    return keys.run_key(prefix, run_id)


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


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _entries(raw: Sequence[Any] | None) -> list[Entry]:
    # Redis 6.2 XAUTOCLAIM reports a deleted entry as (None, None) and keeps it pending; it is
    # acknowledged when it comes back through the consumer's own history (with no fields).
    return [Entry(id=eid, fields=fields or {}) for eid, fields in raw or () if eid is not None]


class EventStream:
    """Redis operations of the accounting consumers, for one key prefix."""

    def __init__(self, redis: Redis, prefix: str, group: str = CONSUMER_GROUP) -> None:
        self.redis = redis
        self.prefix = prefix
        self.group = group
        self._dead_letter = redis.register_script(_DEAD_LETTER_LUA)

    def events_key(self, run_id: str) -> str:
        return events_key(self.prefix, run_id)

    def dead_key(self, run_id: str) -> str:
        return dead_key(self.prefix, run_id)

    async def run_ids(self) -> list[str]:
        """The runs the drain visits: those of the active index (app/broker/store.py). A closed
        run leaves it once its events are all drained, and comes back before it emits another."""
        raw: Any = await self.redis.zrange(keys.active_key(self.prefix), 0, -1)
        return [_text(r) for r in raw]

    async def run_exists(self, run_id: str) -> bool:
        return bool(await self.redis.exists(run_key(self.prefix, run_id)))

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
        """Entries never delivered to the group, from every stream in one call."""
        if not run_ids:
            return {}
        keys = {self.events_key(r): r for r in run_ids}
        reply: Any = await self.redis.xreadgroup(
            self.group,
            consumer,
            dict.fromkeys(keys, ">"),
            count=count,
            block=block_ms,
        )
        result: dict[str, list[Entry]] = {}
        for key, raw in reply or ():
            entries = _entries(raw)
            if entries:
                result[keys[_text(key)]] = entries
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
        entries still in the stream, which trimming keeps to the pending window.
        """
        key = self.events_key(run_id)
        try:
            groups: Any = await self.redis.xinfo_groups(key)
        except ResponseError:
            return 0  # no stream: nothing was ever emitted
        ours = next((g for g in groups if _text(g["name"]) == self.group), None)
        if ours is None:
            return int(await self.redis.xlen(key))  # nothing has been read yet
        lag = ours.get("lag")
        if lag is None:
            lag = await self.undelivered(run_id, ours["last-delivered-id"])
        return int(ours["pending"]) + int(lag)

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
