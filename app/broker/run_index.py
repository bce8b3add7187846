"""The run indexes of a broker prefix: ``RUNS`` holds every run by creation time, for listing;
``ACTIVE`` holds the runs the workers visit: open runs, and closed ones until they have settled
(nothing live, every event drained). Both are written before the run's own keys (create_run,
wake), so a run is never without its entries, on one Redis or on a cluster, where they live in
other slots. The order of the two writes matters only in that both come first; an entry whose
run does not exist is skipped by the readers and cleared after ORPHAN_GRACE_MS."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Literal

from redis.asyncio import Redis

from app import keys
from app.broker.config import RunConfig
from app.broker.records import RunPage, RunState
from app.broker.replies import text

# The active index lives in one slot of its own, so these touch only it. A token is the time
# (ms) of the call, and always above the run's previous token and above `floor`: it only ever
# grows, so a worker that read an older one cannot take the run out after a wake-up.
_ACTIVATE_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local s = math.max(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(ARGV[2]))
local prev = redis.call('ZSCORE', KEYS[1], ARGV[1])
if prev then s = math.max(s, tonumber(prev) + 1) end
s = string.format('%d', s)
redis.call('ZADD', KEYS[1], s, ARGV[1])
return s
"""
_DEACTIVATE_LUA = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s and tonumber(s) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""

# An active-index entry whose run does not exist is a creation under way (the index is written
# first) or one that never finished; after this long, it is the latter.
ORPHAN_GRACE_MS = 10 * 60 * 1000
# A page of GET /v1/runs reads at most this many runs beyond those it returns (runs of the
# other status, runs being created or deleted); it is then short.
PAGE_SCAN_SLACK = 10_000
# A listing of some runs only reads the index's ids this many at a time, and the states of
# those it may show alone: the runs it may not show are never read, counted or named.
ID_CHUNK = 1000

RunStatus = Literal["open", "closed"]
Visible = Callable[[str], bool]
"""Whether a listing may show a run (by its id): a caller limited to some runs sees only those."""


RUN_FIELDS = ("cfg", "ver", "st", "created", "live", "leased", "floor")


def _run_state(run_id: str, f: Sequence[Any]) -> RunState | None:
    if f[0] is None:
        return None  # no such run, or the tombstone of a deleted one
    cfg = text(f[0])
    return RunState(
        run_id=run_id,
        config=RunConfig.model_validate_json(cfg),
        config_json=cfg,
        policy_version=int(f[1]),
        status="closed" if text(f[2]) == "closed" else "open",
        created_at_ms=int(f[3]),
        live=int(f[4]),
        leased=int(f[5]),
        floor=int(f[6]),
    )


def _score_text(score: float) -> str:
    """A score as Redis reads it back exactly (an integer, the usual case, without '.0')."""
    return f"{score:.17g}"


def _cursor(score: float, run_id: str) -> str:
    """A page's ``next_cursor``: the last entry read, '<creation ms>:<run id>'."""
    return f"{_score_text(score)}:{run_id}"


def _parse_cursor(cursor: str | None) -> tuple[float, str] | None:
    if cursor is None:
        return None
    ms, sep, rid = cursor.partition(":")
    try:
        score = float(ms)
    except ValueError:
        score = math.nan
    if not sep or not rid or not math.isfinite(score) or ms != _score_text(score):
        raise ValueError(f"not a cursor of this listing: {cursor!r}")
    return score, rid


class RunIndex:
    """The run indexes, and the runs' states read through them."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self._activate = redis.register_script(_ACTIVATE_LUA)
        self._deactivate = redis.register_script(_DEACTIVATE_LUA)

    # -- keys -----------------------------------------------------------------------------
    def run_key(self, run_id: str) -> str:
        return keys.run_key(self.prefix, run_id)

    def events_key(self, run_id: str) -> str:
        return keys.events_key(self.prefix, run_id)

    @property
    def runs_key(self) -> str:
        return keys.runs_key(self.prefix)

    @property
    def active_key(self) -> str:
        return keys.active_key(self.prefix)

    async def activate(self, run_id: str, floor: int = 0) -> int:
        """Put the run in the active index; returns its new token (above ``floor``)."""
        return int(await self._activate(keys=[self.active_key], args=[run_id, floor]))

    async def deactivate(self, run_id: str, token: int) -> bool:
        """Take the run out of the active index if its token is still ``token``."""
        return bool(await self._deactivate(keys=[self.active_key], args=[run_id, token]))

    async def active_runs(self) -> list[tuple[str, int]]:
        """(run id, token) of every run the workers visit."""
        rows: list[Any] = await self.redis.zrange(self.active_key, 0, -1, withscores=True)
        return [(text(rid), int(score)) for rid, score in rows]

    async def get_run(self, run_id: str) -> RunState | None:
        f: list[Any] = await self.redis.hmget(self.run_key(run_id), *RUN_FIELDS)
        return _run_state(run_id, f)

    async def run_ids(self) -> list[str]:
        """The runs the workers visit (the active index), oldest token first."""
        return [rid for rid, _ in await self.active_runs()]

    async def list_runs(
        self,
        status: RunStatus | None = None,
        limit: int = 100,
        cursor: str | None = None,
        visible: Visible | None = None,
    ) -> RunPage:
        """Runs newest first (by creation, then id), ``limit`` at most, after ``cursor`` (a
        previous page's ``next_cursor``); ValueError for a malformed cursor. With ``visible``,
        only the runs it admits: they fill the page, and the cursor names one of them.

        Open runs come from the active index, which holds them all and few others, ordered
        here; the others from the run index, newest first. A page reads the states of at most
        PAGE_SCAN_SLACK runs beyond its own, and is then short, with a cursor."""
        after = _parse_cursor(cursor)
        if status == "open":
            return await self._list_open(limit, after, visible)
        runs: list[RunState] = []
        read, last = 0, after
        chunk_size = limit if visible is None else ID_CHUNK
        async with contextlib.aclosing(self._entries_after(after, visible, chunk_size)) as entries:
            while len(runs) < limit and read < limit + PAGE_SCAN_SLACK:
                chunk = await _take(entries, limit - len(runs))
                if not chunk:
                    return RunPage(runs, None)
                read += len(chunk)
                states = await self._states([rid for rid, _ in chunk])
                for (rid, created), state in zip(chunk, states, strict=True):
                    last = (created, rid)
                    if state is not None and status in (None, state.status):
                        runs.append(state)
        return RunPage(runs, _cursor(*last) if last else None)

    async def _entries_after(
        self, after: tuple[float, str] | None, visible: Visible | None, chunk: int
    ) -> AsyncGenerator[tuple[str, float], None]:
        """The run index's entries after ``after`` that ``visible`` admits, newest first, read
        ``chunk`` at a time."""
        while rows := await self._index_after(after, chunk):
            for rid, created in rows:
                if visible is None or visible(rid):
                    yield rid, created
            after = (rows[-1][1], rows[-1][0])

    async def _index_after(
        self, after: tuple[float, str] | None, count: int
    ) -> list[tuple[str, float]]:
        """Up to ``count`` entries of the run index after ``after``, newest first; entries of
        one score in reverse id order, as ZREVRANGEBYSCORE gives them."""
        if after is None:
            rows: list[Any] = await self.redis.zrevrangebyscore(
                self.runs_key, "+inf", "-inf", start=0, num=count, withscores=True
            )
            return [(text(r), float(sc)) for r, sc in rows]
        score, rid = after
        exact = _score_text(score)
        # Runs created in the same millisecond: as many as Redis can create in one.
        ties: list[Any] = await self.redis.zrevrangebyscore(self.runs_key, exact, exact)
        got = [(text(r), score) for r in ties if text(r).encode() < rid.encode()][:count]
        if len(got) < count:
            older: list[Any] = await self.redis.zrevrangebyscore(
                self.runs_key, f"({exact}", "-inf", start=0, num=count - len(got), withscores=True
            )
            got += [(text(r), float(sc)) for r, sc in older]
        return got

    async def _list_open(
        self, limit: int, after: tuple[float, str] | None, visible: Visible | None
    ) -> RunPage:
        ids = [rid for rid, _ in await self.active_runs() if visible is None or visible(rid)]
        states = [s for s in await self._states(ids) if s is not None and s.status == "open"]
        order = sorted(states, key=lambda s: (s.created_at_ms, s.run_id.encode()), reverse=True)
        if after is not None:
            order = [
                s
                for s in order
                if (s.created_at_ms, s.run_id.encode()) < (after[0], after[1].encode())
            ]
        page = order[:limit]
        more = len(order) > limit
        return RunPage(page, _cursor(page[-1].created_at_ms, page[-1].run_id) if more else None)

    async def _states(self, run_ids: Sequence[str]) -> list[RunState | None]:
        """Each run as get_run reads it (None: no such run, or a deleted one's tombstone)."""
        out: list[RunState | None] = []
        for start in range(0, len(run_ids), 1000):
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid in run_ids[start : start + 1000]:
                    pipe.hmget(self.run_key(rid), *RUN_FIELDS)
                rows = await pipe.execute()
            out += [
                _run_state(rid, f)
                for rid, f in zip(run_ids[start : start + 1000], rows, strict=True)
            ]
        return out


async def _take(entries: AsyncIterator[tuple[str, float]], count: int) -> list[tuple[str, float]]:
    """The next ``count`` entries of ``entries`` (fewer at its end)."""
    out: list[tuple[str, float]] = []
    if count > 0:
        async for entry in entries:
            out.append(entry)
            if len(out) == count:
                break
    return out
