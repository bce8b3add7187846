"""Draining the run event streams into Postgres: at-least-once from Redis, exactly-once in
Postgres. A batch of entries is applied in one transaction, committed, and only then
acknowledged; an entry delivered again is found in ``processed_events`` and skipped.

Every consumer sends a heartbeat to Redis; the entries of one that has gone silent for
``heartbeat_timeout_ms`` are taken over by another, and the silent one is deleted from the
groups, so a crashed worker's entries come back within seconds and the groups do not grow with
restarts.
Once a run has gone quiet, the drain checks its ledger against the broker's live counts.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import ResponseError
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.accounting import ledger, repository
from app.accounting.drain_options import DrainCounts, DrainOptions
from app.accounting.stream import Entry, EventStream, StreamGone
from app.errors import NotReplicated
from app.events import Event, EventError, decode_entry
from app.replicas import Replicas

__all__ = [
    "DrainCounts",
    "DrainOptions",
    "Drainer",
    "consumer_name",
]

log = logging.getLogger(__name__)


def consumer_name() -> str:
    """Unique per process, so entries of a killed process are recognisably someone else's;
    its heartbeats tell the others when it is gone."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _entry_error(exc: BaseException) -> bool:
    """True for errors caused by the data of an event, which fail the same way on every retry:
    an event the fold cannot apply (:class:`EventError`), SQLSTATE classes 22 (data exception)
    and 23 (integrity), or a value the driver refused to bind. Connection and server trouble is
    not one."""
    if isinstance(exc, EventError):
        return True
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            break
        sqlstate = getattr(seen, "sqlstate", None) or getattr(seen, "pgcode", None)
        if isinstance(sqlstate, str) and sqlstate[:2] in ("22", "23"):
            return True
        if seen is not exc and isinstance(seen, TypeError | ValueError | OverflowError):
            return True
        seen = getattr(seen, "orig", None) if seen is exc else seen.__cause__
    return False


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


@dataclass
class _Failure:
    entry: Entry
    error: str


@dataclass
class Drainer:
    """One consumer of the accounting group, draining every run stream of a prefix."""

    stream: EventStream
    sessionmaker: async_sessionmaker[AsyncSession]
    consumer: str
    options: DrainOptions = field(default_factory=DrainOptions)
    replicas: Replicas | None = None  # with options.wait_replicas
    _grouped: set[str] = field(default_factory=set, init=False)
    # Runs where this consumer may hold unacknowledged entries (read, then failed or crashed).
    _dirty: set[str] = field(default_factory=set, init=False)
    _last_claim: float = field(default=float("-inf"), init=False)
    _last_beat: float = field(default=float("-inf"), init=False)
    _last_takeover: float = field(default=float("-inf"), init=False)
    # Runs with entries applied or dead-lettered since their ledger was last checked.
    _unchecked: set[str] = field(default_factory=set, init=False)
    # Ledger checks that found ledger != live, since this consumer started.
    mismatches: int = field(default=0, init=False)

    @classmethod
    def create(
        cls,
        redis: Redis,
        sessionmaker: async_sessionmaker[AsyncSession],
        prefix: str,
        options: DrainOptions | None = None,
        consumer: str | None = None,
    ) -> Drainer:
        options = options or DrainOptions()
        wait = options.wait_replicas
        return cls(
            stream=EventStream(redis, prefix),
            sessionmaker=sessionmaker,
            consumer=consumer or consumer_name(),
            options=options,
            replicas=Replicas(redis, wait, options.wait_timeout_ms) if wait else None,
        )

    async def streams(self) -> list[str]:
        """Run ids whose stream exists and has the consumer group."""
        run_ids = await self.stream.run_ids()
        for run_id in run_ids:
            if run_id not in self._grouped and await self.stream.ensure_group(run_id):
                self._grouped.add(run_id)
                # A consumer restarted under the same name (BROKER_DRAIN_CONSUMER) may hold
                # entries its previous life read but never acknowledged: read those first.
                self._dirty.add(run_id)
        return [r for r in run_ids if r in self._grouped]

    async def beat(self) -> None:
        """Tell the other consumers this one is alive (``run_drain`` also does it from a task
        of its own, so a long pass does not look like a death)."""
        await self.stream.beat(self.consumer)
        self._last_beat = time.monotonic()

    async def drain_once(
        self, *, block_ms: int | None = None, claim: bool | None = None
    ) -> DrainCounts:
        """One pass (see :meth:`_pass`). When a Redis master dies before its replica has the
        acks it was sent, the promoted replica still lists entries this consumer applied as
        pending here, and nobody else would take them for ``claim_idle_ms``. So after a pass
        that failed, the next one checks every run's group again and re-reads this consumer's
        own pending entries of every run; and since a client may carry its commands over to the
        promoted replica without failing any (redis-py 8.2 retries with a backoff), every
        heartbeat interval re-reads them too. Re-reading them only acknowledges them (each is
        applied once, by its stream id); with none pending it is one empty read a run."""
        try:
            return await self._pass(block_ms=block_ms, claim=claim)
        except Exception:
            self._grouped.clear()
            raise

    async def _pass(self, *, block_ms: int | None, claim: bool | None) -> DrainCounts:
        """One pass: a heartbeat and the take-over of silent consumers (both every quarter of
        ``heartbeat_timeout_ms``), own pending entries (of the runs marked, and of every run on
        the take-over's schedule), then entries idle for
        ``claim_idle_ms`` of any consumer (every half ``claim_idle_ms``, or when ``claim`` is
        true), then new entries; then trim; then check the ledger of the runs that went
        quiet."""
        counts = DrainCounts()
        now = time.monotonic()
        if now - self._last_beat >= self.options.beat_s:
            await self.beat()  # before any read: a consumer is known before it holds entries
        run_ids = await self.streams()
        counts.streams = len(run_ids)
        if now - self._last_takeover >= self.options.beat_s:
            self._last_takeover = now
            counts.add(await self.take_over_silent(run_ids))
            self._dirty.update(run_ids)  # acks a failover lost without failing a command
        touched: set[str] = set()
        for run_id in sorted(self._dirty.intersection(run_ids)):
            got = await self._unless_gone(run_id, self.drain_own_pending)
            if got.read:
                touched.add(run_id)
            counts.add(got)
        if claim or (claim is None and now - self._last_claim >= self.options.claim_idle_ms / 2000):
            self._last_claim = now
            alive = await self.stream.beating(self.options.heartbeat_timeout_ms)
            for run_id in [r for r in run_ids if r in self._grouped]:
                got = await self._unless_gone(run_id, self.drain_claimable)
                got.consumers_deleted += await self._delete_gone(run_id, alive)
                if got.read or got.missing:
                    touched.add(run_id)
                counts.add(got)
        busy = await self._read_new([r for r in run_ids if r in self._grouped], counts, block_ms)
        touched |= busy
        if self.options.trim:
            for run_id in sorted(touched):
                counts.trimmed += await self.stream.trim_acknowledged(run_id)
        # A run that got nothing new in this pass may have caught up: check its ledger.
        for run_id in sorted(self._unchecked.intersection(run_ids) - busy):
            counts.add(await self.check_ledger(run_id))
        return counts

    async def _read_new(
        self, run_ids: list[str], counts: DrainCounts, block_ms: int | None
    ) -> set[str]:
        """Process new entries of ``run_ids`` (blocking ``block_ms`` if the pass read nothing),
        in rounds while a stream has a full batch; adds to ``counts``, returns the runs read."""
        active = list(run_ids)
        busy: set[str] = set()
        block = block_ms if counts.read == 0 else None
        for _ in range(self.options.max_rounds):
            if not active:
                break
            try:
                new = await self.stream.read_new(
                    active, self.consumer, self.options.batch_size, block
                )
            except StreamGone as gone:
                self._skip(gone)
                active.remove(gone.run_id)
                continue
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self._grouped.clear()  # a stream was deleted and recreated: re-create groups
                break
            block = None
            for run_id, entries in new.items():
                busy.add(run_id)
                counts.add(await self.process(run_id, entries))
            active = [r for r in active if len(new.get(r, ())) >= self.options.batch_size]
        return busy

    async def _unless_gone(
        self, run_id: str, read: Callable[[str], Awaitable[DrainCounts]]
    ) -> DrainCounts:
        """``read(run_id)``, or nothing read when the run's stream went meanwhile."""
        try:
            return await read(run_id)
        except StreamGone as gone:
            self._skip(gone)
            return DrainCounts()

    def _skip(self, gone: StreamGone) -> None:
        """One line, and no more reads of the run until :meth:`streams` finds its group again."""
        log.info(
            "run %r: its event stream or consumer group is gone (the run was deleted "
            "meanwhile); the drain skips it",
            gone.run_id,
        )
        self._grouped.discard(gone.run_id)
        self._dirty.discard(gone.run_id)

    async def check_ledger(self, run_id: str) -> DrainCounts:
        """Compare the run's ledger with the broker's live counts once nothing is pending; a
        mismatch is logged and counted (``mismatches``). While events are pending, or when the
        ledger moved past the live read, the run stays to be checked on a later pass."""
        counts = DrainCounts()
        async with self.sessionmaker() as session:
            check = await ledger.check_ledger(session, self.stream, run_id)
        if not check.settled:
            return counts
        self._unchecked.discard(run_id)
        if check.live is None:
            return counts  # no live state to compare with (the run was deleted)
        counts.checked += 1
        if check.mismatch:
            counts.mismatched += 1
            self.mismatches += 1
            log.error(
                "ledger of run %s disagrees with the live state once caught up: buffered %d "
                "(live %d), leased %d (live %d), awaiting a reward %d (live %d), reward-leased "
                "%d (live %d), %d dead letters",
                run_id,
                check.buffered,
                check.live.buffered,
                check.leased,
                check.live.leased,
                check.rewards[0],
                check.live.rewards.awaiting,
                check.rewards[1],
                check.live.rewards.leased,
                check.dead_letters,
            )
        return counts

    async def take_over_silent(self, run_ids: Sequence[str]) -> DrainCounts:
        """Take over the consumers with no heartbeat for ``heartbeat_timeout_ms``: move their
        pending entries here (read on this pass as this consumer's own), delete them from every
        group and forget them. A consumer that was alive after all loses nothing: an entry it was
        still working on is applied twice, and the second time is skipped."""
        counts = DrainCounts()
        mark, silent = await self.stream.take_silent(
            self.options.heartbeat_timeout_ms, self.options.max_takeovers
        )
        for name in silent:
            if name == self.consumer:
                continue  # this process was too busy to beat; it is alive
            claimed = 0
            for run_id in run_ids:
                n = await self.stream.claim_all(
                    run_id, name, self.consumer, self.options.batch_size
                )
                if n:
                    claimed += n
                    self._dirty.add(run_id)
                if await self.stream.delete_consumer(run_id, name) == 1:
                    counts.consumers_deleted += 1
            counts.taken_over += claimed
            await self.stream.forget(name, mark)
            log.info(
                "drain consumer %s silent for %d ms: took over its %d pending entries",
                name,
                self.options.heartbeat_timeout_ms,
                claimed,
            )
        return counts

    async def _delete_gone(self, run_id: str, alive: set[str]) -> int:
        """Delete the consumers of one run's group that hold nothing, have been idle for
        ``claim_idle_ms`` and send no heartbeat (they predate heartbeats, or their heartbeat
        was lost): what the take-over of silent consumers does not see."""
        deleted = 0
        for name, pending, idle_ms in await self.stream.consumers(run_id):
            if name == self.consumer or name in alive:
                continue
            if pending == 0 and idle_ms >= self.options.claim_idle_ms:
                deleted += await self.stream.delete_consumer(run_id, name) == 1
        return deleted

    async def leave(self) -> None:
        """On a clean stop: delete this consumer from the groups where it holds nothing, and,
        if it holds nothing anywhere, its heartbeat. A consumer that still holds entries keeps
        its last heartbeat, so that another one takes them over once it is silent."""
        holding = False
        for run_id in sorted(self._grouped):
            holding |= await self.stream.delete_consumer(run_id, self.consumer) == -1
        if not holding:
            await self.stream.leave(self.consumer)

    async def drain_own_pending(self, run_id: str) -> DrainCounts:
        """Re-deliver this consumer's unacknowledged entries (each once per call)."""
        counts = DrainCounts()
        after = b"0"
        while True:
            entries = await self.stream.read_own_pending(
                run_id, self.consumer, after, self.options.batch_size
            )
            if not entries:
                break
            counts.add(await self.process(run_id, entries))
            after = entries[-1].id
            if len(entries) < self.options.batch_size:
                break
        if counts.read == 0 or counts.retrying + counts.unreplicated == 0:
            self._dirty.discard(run_id)
        return counts

    async def drain_claimable(self, run_id: str) -> DrainCounts:
        """Claim and process entries left idle by other consumers (a crashed worker's)."""
        counts = DrainCounts()
        start = b"0-0"
        # XAUTOCLAIM scans a bounded stretch of the pending list per call; follow its cursor.
        for _ in range(1000):
            start, entries, deleted = await self.stream.claim_idle(
                run_id, self.consumer, self.options.claim_idle_ms, start, self.options.batch_size
            )
            counts.missing += len(deleted)
            if entries:
                counts.add(await self.process(run_id, entries))
            if start == b"0-0":
                break
        return counts

    async def process(self, run_id: str, entries: Sequence[Entry]) -> DrainCounts:
        """Apply delivered entries: one transaction, commit, then XACK. Entries that cannot be
        applied stay pending and are dead-lettered after ``max_deliveries`` deliveries."""
        was_dirty = run_id in self._dirty
        self._dirty.add(run_id)  # stays marked if anything below raises
        counts = DrainCounts(read=len(entries))
        if not await self._replicated(run_id, len(entries)):
            counts.unreplicated = len(entries)  # left pending, read again on a later pass
            return counts
        events: list[tuple[Entry, Event]] = []
        failures: list[_Failure] = []
        done: list[bytes] = []
        for entry in entries:
            if not entry.fields:
                # Deleted from the stream while pending: nothing left to apply.
                counts.missing += 1
                done.append(entry.id)
                continue
            try:
                events.append((entry, decode_entry(run_id, entry.id, entry.fields)))
            except EventError as exc:
                failures.append(_Failure(entry, f"{type(exc).__name__}: {exc}"))
        if events:
            try:
                result = await self._commit(run_id, [e for _, e in events])
                counts.applied += result.applied
                counts.already += result.already
                done.extend(entry.id for entry, _ in events)
            except (DBAPIError, StatementError, EventError) as exc:
                if not _entry_error(exc):
                    raise
                # One of them is bad: apply one by one so the rest are not held back.
                for entry, event in events:
                    try:
                        result = await self._commit(run_id, [event])
                    except (DBAPIError, StatementError, EventError) as one:
                        if not _entry_error(one):
                            raise
                        failures.append(_Failure(entry, f"{type(one).__name__}: {one}"))
                        continue
                    counts.applied += result.applied
                    counts.already += result.already
                    done.append(entry.id)
        counts.acked += await self.stream.ack(run_id, done)
        if failures:
            await self._settle_failures(run_id, failures, counts)
        if counts.applied or counts.dead:
            self._unchecked.add(run_id)
        if not was_dirty and counts.retrying == 0:
            self._dirty.discard(run_id)
        return counts

    async def _replicated(self, run_id: str, read: int) -> bool:
        """Whether the run's events read so far are on the replicas BROKER_REDIS_WAIT_REPLICAS
        asks for (always, without it): so the ledger never holds an event that the replica
        promoted in a failover lacks."""
        if self.replicas is None:
            return True
        try:
            await self.replicas.barrier(keys.sync_key(self.stream.prefix, run_id))
        except NotReplicated as exc:
            log.warning("run %s: %d events left pending, not committed: %s", run_id, read, exc)
            return False
        return True

    async def _commit(self, run_id: str, events: Sequence[Event]) -> repository.ApplyResult:
        async with self.sessionmaker() as session, session.begin():
            return await repository.apply_events(session, run_id, events)

    async def _settle_failures(
        self, run_id: str, failures: Sequence[_Failure], counts: DrainCounts
    ) -> None:
        deliveries = await self.stream.delivery_counts(run_id, [f.entry.id for f in failures])
        for failure in failures:
            n = deliveries.get(failure.entry.id)
            if n is None:
                continue  # no longer pending: another consumer settled it
            if n < self.options.max_deliveries:
                counts.retrying += 1
                log.warning(
                    "event %s of run %s failed (delivery %d of %d): %s",
                    _text(failure.entry.id),
                    run_id,
                    n,
                    self.options.max_deliveries,
                    failure.error,
                )
                continue
            if await self.stream.dead_letter(
                run_id, failure.entry, error=failure.error, deliveries=n, consumer=self.consumer
            ):
                counts.dead += 1
                log.error(
                    "event %s of run %s dead-lettered after %d deliveries: %s",
                    _text(failure.entry.id),
                    run_id,
                    n,
                    failure.error,
                )
