"""The drain consumers of the accounting's consumer group: their heartbeats (by the Redis
server's clock), the take-over of the silent ones and the deletion of the gone ones.
:class:`ConsumerGroup` is the base of :class:`app.accounting.stream.EventStream`."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from app import keys

__all__ = ["ALIVE_WITHIN_S", "ConsumerGroup", "as_text", "drain_check"]

# The SPEC's "Configuration and start-up": the broker is ready only while a background worker
# was alive within the last minute, told by the newest drain consumer heartbeat (drain_check).
ALIVE_WITHIN_S = 60


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

# Redis's own clock and the newest heartbeat, read on the node that holds the key (on a
# cluster, the clock the heartbeats were scored by). Writes nothing.
_NEWEST_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local newest = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #newest == 0 then return {now} end
return {now, newest[2]}
"""

# Delete a consumer from a stream's group only while it holds no pending entry: checked and
# done in one step, so an entry delivered to it meanwhile is never dropped from the group's
# pending list (DELCONSUMER forgets whatever the consumer still holds). A consumer that is
# alive after all is created again by its next read. 1: deleted, 0: not in the group (or no
# stream or no group), -1: it holds entries. Any other error (a write Redis refuses) is raised.
_DELETE_IDLE_CONSUMER_LUA = """
local rows = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if type(rows) == 'table' and rows['err'] then
  if string.find(rows['err'], '^NOGROUP') or string.find(rows['err'], 'no such key') then
    return 0
  end
  return rows
end
for _, row in ipairs(rows) do
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


def as_text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class ConsumerGroup:
    """The consumers of the group ``group`` on the run event streams of one key prefix."""

    def __init__(self, redis: Redis, prefix: str, group: str = keys.CONSUMER_GROUP) -> None:
        self.redis = redis
        self.prefix = prefix
        self.group = group
        self._beat = redis.register_script(_BEAT_LUA)
        self._silent = redis.register_script(_SILENT_LUA)
        self._forget = redis.register_script(_FORGET_LUA)
        self._delete_idle_consumer = redis.register_script(_DELETE_IDLE_CONSUMER_LUA)
        self._newest = redis.register_script(_NEWEST_LUA)

    @property
    def consumers_key(self) -> str:
        return keys.drain_consumers_key(self.prefix)

    def events_key(self, run_id: str) -> str:
        return keys.events_key(self.prefix, run_id)

    async def beat(self, consumer: str) -> None:
        """Record that ``consumer`` is alive now."""
        await self._beat(keys=[self.consumers_key], args=[consumer])

    async def take_silent(self, silent_ms: int, limit: int) -> tuple[int, list[str]]:
        """Consumers with no heartbeat for ``silent_ms``, now this caller's to take over for the
        next ``silent_ms``; and the mark to :meth:`forget` them by."""
        mark, names = await self._silent(keys=[self.consumers_key], args=[silent_ms, limit])
        return int(mark), [as_text(n) for n in names]

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
        return {as_text(r) for r in raw}

    async def newest_beat_age_ms(self) -> int | None:
        """How long ago, by Redis's clock, the latest heartbeat of any consumer was; None when
        no consumer has one (none ever ran, or every one left cleanly)."""
        reply: Any = await self._newest(keys=[self.consumers_key], args=[])
        if len(reply) < 2:
            return None
        return int(reply[0]) - int(float(reply[1]))

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
        return [(as_text(r["name"]), int(r["pending"]), int(r["idle"])) for r in rows]

    async def delete_consumer(self, run_id: str, consumer: str) -> int:
        """Delete ``consumer`` from the run's group unless it holds pending entries: 1 when it
        was deleted, 0 when it was not in the group (or there is no group), -1 when it holds
        entries (and stays)."""
        return int(
            await self._delete_idle_consumer(
                keys=[self.events_key(run_id)], args=[self.group, consumer]
            )
        )


async def drain_check(consumers: ConsumerGroup) -> str:
    """Readiness of the accounting drain: ``"ok"`` when a drain consumer sent a heartbeat
    within :data:`ALIVE_WITHIN_S`, else why not (reported, never raised)."""
    try:
        age_ms = await consumers.newest_beat_age_ms()
    except Exception as exc:  # Redis is down: its own check says so too
        return f"unreachable: {type(exc).__name__}"
    if age_ms is None:
        return "no worker is running: start `rollout-broker worker`"
    if age_ms > ALIVE_WITHIN_S * 1000:
        return f"no worker has drained the accounting within {ALIVE_WITHIN_S} s"
    return "ok"
