"""The ledger against the live state: the broker's counts in Redis and the drain's progress
read at one moment with the totals in Postgres (:func:`read_settled`), and the check of the
ledger's ``buffered`` and ``leased``, and of its rollouts awaiting a reward (``rewards``:
awaiting and reward-leased), against them (:func:`check_ledger`), which the drain runs once a
run has gone quiet.

The ledger's ``buffered`` and ``leased`` are its own flow counts (:func:`ledger_counts`). They
are checked against ``live``, the broker's counts in Redis, which no event goes through: an
event the ledger missed or could not apply (a dead letter) shows as ledger != live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ARRAY, Text, bindparam, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from app.accounting.models import RunTotals, VersionTotals
from app.accounting.schemas import LiveCounts, LiveRewardCounts
from app.accounting.stream import EventStream, LiveSnapshot
from app.events import StreamId

__all__ = [
    "LedgerCheck",
    "Settled",
    "check_ledger",
    "check_of",
    "ledger_counts",
    "live_counts",
    "one_snapshot",
    "read_once",
    "read_settled",
    "zero_totals",
]

# Reads of Redis then Postgres before giving up on one moment (see read_settled).
_SETTLE_TRIES = 5


async def one_snapshot(session: AsyncSession) -> None:
    """Read the totals and the rows beside them (reasons, lags) from one snapshot, so a drain
    commit between two SELECTs cannot make them disagree within one answer."""
    await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})


def ledger_counts(totals: RunTotals | VersionTotals) -> tuple[int, int]:
    """(buffered, leased) as the ledger counts them, from the rollouts' moves in and out of
    the buffer: in by ``accepted`` and by every return of a lease (``acked``, ``nacked``,
    ``expired``), out by ``leased`` and ``retired``; leased = out by ``leased`` − returned."""
    returned = totals.rollouts_acked + totals.rollouts_nacked + totals.rollouts_expired
    buffered = (
        totals.rollouts_received + returned - totals.rollouts_leased - totals.rollouts_retired
    )
    return buffered, totals.rollouts_leased - returned


def zero_totals() -> RunTotals:
    row = RunTotals()
    for column in RunTotals.__table__.columns:
        if column.server_default is not None:
            setattr(row, column.key, 0)
    return row


# The newest processed event of each run: one index probe per run (the key's order), however
# many events a run has.
_NEWEST_APPLIED = text(
    """
    SELECT r.run_id, p.stream_ms, p.stream_seq
    FROM unnest(:run_ids) AS r(run_id)
    CROSS JOIN LATERAL (
        SELECT stream_ms, stream_seq FROM processed_events
        WHERE processed_events.run_id = r.run_id
        ORDER BY stream_ms DESC, stream_seq DESC
        LIMIT 1
    ) AS p
    """
).bindparams(bindparam("run_ids", type_=ARRAY(Text)))


async def newest_applied_of(session: AsyncSession, run_ids: Sequence[str]) -> dict[str, StreamId]:
    rows = await session.execute(_NEWEST_APPLIED, {"run_ids": list(run_ids)})
    return {run_id: StreamId(ms, seq) for run_id, ms, seq in rows.all()}


@dataclass(frozen=True, slots=True)
class Settled:
    snapshot: LiveSnapshot
    pending: int
    totals: RunTotals | None
    # The totals hold no event newer than the snapshot: ledger and live describe one moment.
    current: bool

    @property
    def readable(self) -> bool:
        """Ledger and live can be read together: of one moment, or events pending (the ledger
        trails, and says so), or no live state to compare with."""
        return self.current or self.pending > 0 or self.snapshot.live is None


async def read_settled(session: AsyncSession, stream: EventStream, run_id: str) -> Settled:
    """The live snapshot, then the totals: both of one moment whenever nothing is pending.

    Redis is read *before* Postgres: the drain commits before it XACKs, so every event the
    pending count leaves out is already in the rows read next. Read the other way round, a
    drain pass between the two reads would pair stale totals with "nothing pending". The rows
    may instead hold events newer than the snapshot, drained in between: then the ledger is
    ahead of ``live`` and the two cannot be compared, so both are read again.
    """
    for attempt in range(_SETTLE_TRIES):
        settled = (await read_once(session, stream, [run_id]))[run_id]
        if settled.readable or attempt == _SETTLE_TRIES - 1:
            return settled
        await session.rollback()  # ends the snapshot; the next read starts a new one
    raise AssertionError("unreachable")


async def read_once(
    session: AsyncSession, stream: EventStream, run_ids: Sequence[str]
) -> dict[str, Settled]:
    """One read of :func:`read_settled` for several runs: every live snapshot, then the totals
    in one database snapshot (left open for the rows read next)."""
    snapshots = [await stream.live_snapshot(run_id) for run_id in run_ids]
    pending = [await stream.pending_of(r, snap) for r, snap in zip(run_ids, snapshots, strict=True)]
    await one_snapshot(session)
    rows = await session.scalars(select(RunTotals).where(RunTotals.run_id.in_(run_ids)))
    totals = {row.run_id: row for row in rows.all()}
    newest = await newest_applied_of(session, run_ids)
    out = {}
    for run_id, snapshot, waiting in zip(run_ids, snapshots, pending, strict=True):
        last, applied = snapshot.last_delivered, newest.get(run_id)
        current = applied is None or (last is not None and not StreamId.parse(last) < applied)
        out[run_id] = Settled(snapshot, waiting, totals.get(run_id), current)
    return out


@dataclass(frozen=True, slots=True)
class LedgerCheck:
    """The ledger's buffered and leased rollouts against the broker's live ones."""

    run_id: str
    pending: int
    dead_letters: int
    buffered: int
    leased: int
    rewards: tuple[int, int]  # (awaiting, leased) of the rollouts awaiting their reward
    live: LiveCounts | None
    current: bool

    @property
    def settled(self) -> bool:
        """Nothing pending, and the ledger and the live counts read at one moment."""
        return self.pending == 0 and self.current

    @property
    def mismatch(self) -> bool:
        """Settled, and the ledger disagrees with the live counts."""
        if not self.settled or self.live is None:
            return False
        live = self.live
        return (self.buffered, self.leased, *self.rewards) != (
            live.buffered,
            live.leased,
            live.rewards.awaiting,
            live.rewards.leased,
        )


def live_counts(snapshot: LiveSnapshot) -> LiveCounts | None:
    """``live`` of the accounting. The rollouts awaiting a reward lease are those of the run's
    AWAITING hash less those in live reward leases (the run hash's ``rwl``)."""
    buffered = snapshot.buffered
    if buffered is None or snapshot.leased is None:
        return None
    rewards = LiveRewardCounts(
        awaiting=snapshot.unscored - snapshot.reward_leased, leased=snapshot.reward_leased
    )
    return LiveCounts(buffered=buffered, leased=snapshot.leased, rewards=rewards)


def check_of(run_id: str, settled: Settled) -> LedgerCheck:
    totals = settled.totals or zero_totals()
    buffered, leased = ledger_counts(totals)
    return LedgerCheck(
        run_id=run_id,
        pending=settled.pending,
        dead_letters=settled.snapshot.dead_letters,
        buffered=buffered,
        leased=leased,
        rewards=(totals.rewards_awaiting, totals.rewards_leased),
        live=live_counts(settled.snapshot),
        current=settled.current,
    )


async def check_ledger(session: AsyncSession, stream: EventStream, run_id: str) -> LedgerCheck:
    """Compare the run's ledger with the live counts in Redis (see :class:`LedgerCheck`)."""
    return check_of(run_id, await read_settled(session, stream, run_id))
