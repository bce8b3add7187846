"""Read side of the accounting, for the operator API: totals, rows per version of the rollouts
and of the trainer, the batch ledger, the prompt ledger and dead letters; and the check of the
ledger against the broker's live counts (:func:`check_ledger`), which the drain runs once a run
has gone quiet.

The ledger's ``buffered`` and ``leased`` are its own flow counts (:func:`ledger_counts`). They
are checked against ``live``, the broker's counts in Redis, which no event goes through: an
event the ledger missed or could not apply (a dead letter) shows as ledger != live.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import ARRAY, Text, bindparam, select, text, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from app.accounting.models import (
    PASS_STATES,
    Batch,
    LagCount,
    PromptPass,
    ReasonTotals,
    Run,
    RunTotals,
    TrainingTotals,
    VersionTotals,
)
from app.accounting.repository import ms_to_datetime
from app.accounting.schemas import (
    BatchCounts,
    BatchPage,
    BatchRecord,
    DeadLetter,
    DeadLetterPage,
    IsRatioStats,
    KlStats,
    LagStats,
    LiveCounts,
    PromptCounts,
    PromptPage,
    PromptPassRecord,
    RunAccounting,
    TrainingAccounting,
    TrainingVersion,
    VersionAccounting,
    VersionsAccounting,
    WaitStats,
)
from app.accounting.stream import EventStream, LiveSnapshot
from app.errors import BadRequest, RunNotFound, ValidationFailed
from app.events import EventError, StreamId

__all__ = [
    "CheckedAccounting",
    "LedgerCheck",
    "check_ledger",
    "checked_accounting",
    "checked_accounting_of",
    "dead_letters",
    "ledger_counts",
    "list_batches",
    "list_prompts",
    "run_accounting",
    "training_accounting",
    "version_accounting",
]

# Reads of Redis then Postgres before giving up on one moment (see _read_settled).
_SETTLE_TRIES = 5


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


async def _one_snapshot(session: AsyncSession) -> None:
    """Read the totals and the rows beside them (reasons, lags) from one snapshot, so a drain
    commit between two SELECTs cannot make them disagree within one answer."""
    await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})


async def _require_run(session: AsyncSession, stream: EventStream, run_id: str) -> None:
    """A run is known once any of its events is drained, or while it exists in Redis only."""
    if await session.get(RunTotals, run_id) is not None:
        return
    if await session.get(Run, run_id) is not None:
        return
    if await stream.run_exists(run_id):
        return
    raise RunNotFound(f"run {run_id!r} does not exist")


Reasons = dict[int, dict[str, dict[str, int]]]  # policy_version -> kind -> reason -> rollouts
Lags = dict[int, dict[int, int]]  # policy_version -> lag -> samples


async def _reasons(session: AsyncSession, run_id: str) -> Reasons:
    return (await _reasons_of(session, [run_id])).get(run_id, {})


async def _reasons_of(session: AsyncSession, run_ids: Sequence[str]) -> dict[str, Reasons]:
    rows = await session.execute(
        select(
            ReasonTotals.run_id,
            ReasonTotals.policy_version,
            ReasonTotals.kind,
            ReasonTotals.reason,
            ReasonTotals.rollouts,
        )
        .where(ReasonTotals.run_id.in_(run_ids))
        .order_by(
            ReasonTotals.run_id, ReasonTotals.policy_version, ReasonTotals.kind, ReasonTotals.reason
        )
    )
    result: dict[str, Reasons] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for run_id, version, kind, reason, rollouts in rows.all():
        result[run_id][version][kind][reason] = rollouts
    return result


async def _lags(session: AsyncSession, run_id: str) -> Lags:
    return (await _lags_of(session, [run_id])).get(run_id, {})


async def _lags_of(session: AsyncSession, run_ids: Sequence[str]) -> dict[str, Lags]:
    rows = await session.execute(
        select(LagCount.run_id, LagCount.policy_version, LagCount.lag, LagCount.samples)
        .where(LagCount.run_id.in_(run_ids))
        .order_by(LagCount.run_id, LagCount.policy_version, LagCount.lag)
    )
    result: dict[str, Lags] = defaultdict(lambda: defaultdict(dict))
    for run_id, version, lag, samples in rows.all():
        result[run_id][version][lag] = samples
    return result


def _sum_by_reason(per_version: dict[int, dict[str, dict[str, int]]], kind: str) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for kinds in per_version.values():
        for reason, n in kinds.get(kind, {}).items():
            total[reason] += n
    return dict(sorted(total.items()))


def ledger_counts(totals: RunTotals | VersionTotals) -> tuple[int, int]:
    """(buffered, leased) as the ledger counts them, from the rollouts' moves in and out of
    the buffer: in by ``accepted`` and by every return of a lease (``acked``, ``nacked``,
    ``expired``), out by ``leased`` and ``retired``; leased = out by ``leased`` − returned."""
    returned = totals.rollouts_acked + totals.rollouts_nacked + totals.rollouts_expired
    buffered = (
        totals.rollouts_received + returned - totals.rollouts_leased - totals.rollouts_retired
    )
    return buffered, totals.rollouts_leased - returned


def _common(
    totals: RunTotals | VersionTotals,
    rejected: dict[str, int],
    retired: dict[str, int],
    histogram: dict[int, int],
) -> dict[str, Any]:
    """The fields shared by the run and per-version views, from a totals row (or zeros)."""
    received = totals.rollouts_received
    buffered, leased = ledger_counts(totals)
    return {
        "rollouts_received": received,
        "groups_received": totals.groups_received,
        "rejected": rejected,
        "tokens_generated": totals.tokens_generated,
        "buffered": buffered,
        "leased": leased,
        "samples_consumed": totals.rollouts_acked,
        "tokens_consumed": totals.tokens_consumed,
        "reuse_factor": totals.rollouts_acked / received if received else 0.0,
        "retired": retired,
        "wasted_tokens": totals.wasted_tokens,
        "lag": LagStats(
            # Divided exactly: the sum may be far beyond a double's 2^53.
            mean=float(Decimal(totals.lag_sum) / totals.lag_samples)
            if totals.lag_samples
            else None,
            max=totals.lag_max,
            histogram=histogram,
        ),
        "kl": KlStats(mean=_ratio(totals.kl_sum, totals.kl_tokens), max=totals.kl_max),
    }


def _zero_totals() -> RunTotals:
    row = RunTotals()
    for column in RunTotals.__table__.columns:
        if column.server_default is not None:
            setattr(row, column.key, 0)
    return row


async def _newest_applied(session: AsyncSession, run_id: str) -> StreamId | None:
    return (await _newest_applied_of(session, [run_id])).get(run_id)


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


async def _newest_applied_of(session: AsyncSession, run_ids: Sequence[str]) -> dict[str, StreamId]:
    rows = await session.execute(_NEWEST_APPLIED, {"run_ids": list(run_ids)})
    return {run_id: StreamId(ms, seq) for run_id, ms, seq in rows.all()}


@dataclass(frozen=True, slots=True)
class _Settled:
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


async def _read_settled(session: AsyncSession, stream: EventStream, run_id: str) -> _Settled:
    """The live snapshot, then the totals: both of one moment whenever nothing is pending.

    Redis is read *before* Postgres: the drain commits before it XACKs, so every event the
    pending count leaves out is already in the rows read next. Read the other way round, a
    drain pass between the two reads would pair stale totals with "nothing pending". The rows
    may instead hold events newer than the snapshot, drained in between: then the ledger is
    ahead of ``live`` and the two cannot be compared, so both are read again.
    """
    for attempt in range(_SETTLE_TRIES):
        settled = (await _read_once(session, stream, [run_id]))[run_id]
        if settled.readable or attempt == _SETTLE_TRIES - 1:
            return settled
        await session.rollback()  # ends the snapshot; the next read starts a new one
    raise AssertionError("unreachable")


async def _read_once(
    session: AsyncSession, stream: EventStream, run_ids: Sequence[str]
) -> dict[str, _Settled]:
    """One read of :func:`_read_settled` for several runs: every live snapshot, then the totals
    in one database snapshot (left open for the rows read next)."""
    snapshots = [await stream.live_snapshot(run_id) for run_id in run_ids]
    pending = [await stream.pending_of(r, snap) for r, snap in zip(run_ids, snapshots, strict=True)]
    await _one_snapshot(session)
    rows = await session.scalars(select(RunTotals).where(RunTotals.run_id.in_(run_ids)))
    totals = {row.run_id: row for row in rows.all()}
    newest = await _newest_applied_of(session, run_ids)
    out = {}
    for run_id, snapshot, waiting in zip(run_ids, snapshots, pending, strict=True):
        last, applied = snapshot.last_delivered, newest.get(run_id)
        current = applied is None or (last is not None and not StreamId.parse(last) < applied)
        out[run_id] = _Settled(snapshot, waiting, totals.get(run_id), current)
    return out


@dataclass(frozen=True, slots=True)
class LedgerCheck:
    """The ledger's buffered and leased rollouts against the broker's live ones."""

    run_id: str
    pending: int
    dead_letters: int
    buffered: int
    leased: int
    live: LiveCounts | None
    current: bool

    @property
    def settled(self) -> bool:
        """Nothing pending, and the ledger and the live counts read at one moment."""
        return self.pending == 0 and self.current

    @property
    def mismatch(self) -> bool:
        """Settled, and the ledger disagrees with the live counts."""
        return (
            self.settled
            and self.live is not None
            and (self.buffered, self.leased) != (self.live.buffered, self.live.leased)
        )


def _live_counts(snapshot: LiveSnapshot) -> LiveCounts | None:
    buffered = snapshot.buffered
    if buffered is None or snapshot.leased is None:
        return None
    return LiveCounts(buffered=buffered, leased=snapshot.leased)


def _check(run_id: str, settled: _Settled) -> LedgerCheck:
    buffered, leased = ledger_counts(settled.totals or _zero_totals())
    return LedgerCheck(
        run_id=run_id,
        pending=settled.pending,
        dead_letters=settled.snapshot.dead_letters,
        buffered=buffered,
        leased=leased,
        live=_live_counts(settled.snapshot),
        current=settled.current,
    )


async def check_ledger(session: AsyncSession, stream: EventStream, run_id: str) -> LedgerCheck:
    """Compare the run's ledger with the live counts in Redis (see :class:`LedgerCheck`)."""
    return _check(run_id, await _read_settled(session, stream, run_id))


@dataclass(frozen=True, slots=True)
class CheckedAccounting:
    """A run's accounting with the check of its ledger and its totals row, from one read."""

    accounting: RunAccounting
    check: LedgerCheck
    totals: RunTotals  # zeros when nothing was drained yet


async def run_accounting(session: AsyncSession, stream: EventStream, run_id: str) -> RunAccounting:
    return (await checked_accounting(session, stream, run_id)).accounting


async def checked_accounting(
    session: AsyncSession, stream: EventStream, run_id: str
) -> CheckedAccounting:
    """:func:`run_accounting`, and :func:`check_ledger` of the same read (``GET /metrics``)."""
    settled = await _read_settled(session, stream, run_id)
    if settled.totals is None:
        await _require_run(session, stream, run_id)
    return _checked(run_id, settled, await _reasons(session, run_id), await _lags(session, run_id))


async def checked_accounting_of(
    session: AsyncSession, stream: EventStream, run_ids: Sequence[str]
) -> dict[str, CheckedAccounting]:
    """:func:`checked_accounting` of several runs, read together: one database snapshot and a
    few queries for all of them instead of several per run. A run deleted since it was named is
    left out; one whose read was not settled is read again on its own."""
    settled = await _read_once(session, stream, run_ids)
    ready = [r for r in run_ids if settled[r].readable]
    reasons = await _reasons_of(session, ready)
    lags = await _lags_of(session, ready)
    out: dict[str, CheckedAccounting] = {}
    for run_id in ready:
        try:
            if settled[run_id].totals is None:
                await _require_run(session, stream, run_id)
        except RunNotFound:
            continue
        out[run_id] = _checked(
            run_id, settled[run_id], reasons.get(run_id, {}), lags.get(run_id, {})
        )
    session.expunge_all()  # the totals rows answered stay loaded through the rollback
    await session.rollback()  # ends the snapshot: each run read again starts its own
    for run_id in run_ids:
        if run_id not in ready:
            try:
                out[run_id] = await checked_accounting(session, stream, run_id)
            except RunNotFound:
                continue
    return {run_id: out[run_id] for run_id in run_ids if run_id in out}


def _checked(run_id: str, settled: _Settled, reasons: Reasons, lags: Lags) -> CheckedAccounting:
    totals = settled.totals or _zero_totals()
    histogram: dict[int, int] = defaultdict(int)
    for per_lag in lags.values():
        for lag, samples in per_lag.items():
            histogram[lag] += samples
    accounting = RunAccounting(
        **_common(
            totals,
            _sum_by_reason(reasons, "rejected"),
            _sum_by_reason(reasons, "retired"),
            dict(sorted(histogram.items())),
        ),
        duplicates=totals.duplicates,
        batches=BatchCounts(
            leased=totals.batches_leased,
            acked=totals.batches_acked,
            nacked=totals.batches_nacked,
            expired=totals.batches_expired,
        ),
        is_ratio=IsRatioStats(
            mean=_ratio(totals.ratio_sum, totals.ratio_tokens),
            clip_fraction=_ratio(totals.ratio_clipped, totals.ratio_tokens),
        ),
        prompts=PromptCounts(
            registered=totals.prompts_registered,
            queued=totals.prompts_queued,
            in_flight=totals.prompts_in_flight,
            done=totals.prompts_done,
            failed=totals.prompts_failed,
            retried=totals.prompts_retried,
        ),
        wait=WaitStats(
            generator_s=totals.generator_wait_ms / 1000,
            trainer_s=totals.trainer_wait_ms / 1000,
        ),
        as_of=ms_to_datetime(totals.last_event_ms),
        pending_events=settled.pending,
        dead_letters=settled.snapshot.dead_letters,
        live=_live_counts(settled.snapshot),
    )
    return CheckedAccounting(accounting, _check(run_id, settled), totals)


async def version_accounting(
    session: AsyncSession, stream: EventStream, run_id: str
) -> VersionsAccounting:
    pending = await stream.pending_events(run_id)  # first, as in run_accounting
    await _one_snapshot(session)
    totals = await session.get(RunTotals, run_id)
    if totals is None:
        await _require_run(session, stream, run_id)
    rows = await session.scalars(
        select(VersionTotals)
        .where(VersionTotals.run_id == run_id)
        .order_by(VersionTotals.policy_version)
    )
    reasons = await _reasons(session, run_id)
    lags = await _lags(session, run_id)
    versions = [
        VersionAccounting(
            policy_version=row.policy_version,
            **_common(
                row,
                dict(reasons.get(row.policy_version, {}).get("rejected", {})),
                dict(reasons.get(row.policy_version, {}).get("retired", {})),
                lags.get(row.policy_version, {}),
            ),
        )
        for row in rows.all()
    ]
    return VersionsAccounting(
        versions=versions,
        as_of=ms_to_datetime(totals.last_event_ms if totals is not None else None),
        pending_events=pending,
    )


async def training_accounting(
    session: AsyncSession, stream: EventStream, run_id: str
) -> TrainingAccounting:
    """Per policy version of the trainer (the V of the acknowledged batches' leases)."""
    pending = await stream.pending_events(run_id)  # first, as in run_accounting
    await _one_snapshot(session)
    if await session.get(RunTotals, run_id) is None:
        await _require_run(session, stream, run_id)
    rows = await session.scalars(
        select(TrainingTotals)
        .where(TrainingTotals.run_id == run_id)
        .order_by(TrainingTotals.policy_version)
    )
    return TrainingAccounting(
        versions=[
            TrainingVersion(
                policy_version=row.policy_version,
                batches=row.batches,
                samples=row.samples,
                tokens=row.tokens,
                kl_mean=_ratio(row.kl_sum, row.kl_tokens),
                kl_max=row.kl_max,
                is_ratio_mean=_ratio(row.ratio_sum, row.ratio_tokens),
                clip_fraction=_ratio(row.ratio_clipped, row.ratio_tokens),
            )
            for row in rows.all()
        ],
        pending_events=pending,
    )


_BIGINT_MAX = 2**63 - 1


def _encode_cursor(batch: Batch) -> str:
    raw = json.dumps([batch.event_ms, batch.event_seq, batch.batch_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[int, int, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        ms, seq, batch_id = json.loads(raw)
        # Only what the ledger can hold: Postgres refuses NUL in text and ints beyond bigint.
        if not (
            all(type(n) is int and -_BIGINT_MAX - 1 <= n <= _BIGINT_MAX for n in (ms, seq))
            and isinstance(batch_id, str)
            and "\x00" not in batch_id
        ):
            raise ValueError(cursor)
    except (binascii.Error, ValueError, TypeError):
        raise BadRequest("invalid cursor") from None
    return ms, seq, batch_id


async def list_batches(
    session: AsyncSession, stream: EventStream, run_id: str, *, limit: int, cursor: str | None
) -> BatchPage:
    """The batch ledger in lease order, ``limit`` rows after ``cursor``."""
    await _require_run(session, stream, run_id)
    query = select(Batch).where(Batch.run_id == run_id)
    if cursor is not None:
        query = query.where(
            tuple_(Batch.event_ms, Batch.event_seq, Batch.batch_id)
            > tuple_(*_decode_cursor(cursor))
        )
    query = query.order_by(Batch.event_ms, Batch.event_seq, Batch.batch_id).limit(limit + 1)
    rows = list((await session.scalars(query)).all())
    more = len(rows) > limit
    rows = rows[:limit]
    return BatchPage(
        batches=[BatchRecord.model_validate(row, from_attributes=True) for row in rows],
        next_cursor=_encode_cursor(rows[-1]) if more else None,
    )


def _encode_prompt_cursor(prompt_id: str, pass_: int) -> str:
    raw = json.dumps([prompt_id, pass_]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_prompt_cursor(cursor: str) -> tuple[str, int]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        prompt_id, pass_ = json.loads(raw)
        # Only what the ledger can hold: Postgres refuses NUL in text and ints beyond bigint.
        if not (
            isinstance(prompt_id, str)
            and "\x00" not in prompt_id
            and type(pass_) is int
            and 1 <= pass_ <= _BIGINT_MAX
        ):
            raise ValueError(cursor)
    except (binascii.Error, ValueError, TypeError):
        raise ValidationFailed("invalid cursor") from None
    return prompt_id, pass_


async def list_prompts(
    session: AsyncSession,
    stream: EventStream,
    run_id: str,
    *,
    state: str | None,
    limit: int,
    cursor: str | None,
) -> PromptPage:
    """The prompt ledger in (prompt_id, pass) order, of one state or all, ``limit`` passes
    after ``cursor``."""
    if state is not None and state not in PASS_STATES:
        raise ValidationFailed(f"state must be one of {', '.join(PASS_STATES)}, not {state!r}")
    after = _decode_prompt_cursor(cursor) if cursor is not None else None
    await _require_run(session, stream, run_id)
    query = select(PromptPass).where(PromptPass.run_id == run_id)
    if state is not None:
        query = query.where(PromptPass.state == state)
    if after is not None:
        query = query.where(tuple_(PromptPass.prompt_id, PromptPass.pass_) > tuple_(*after))
    query = query.order_by(PromptPass.prompt_id, PromptPass.pass_).limit(limit + 1)
    rows = list((await session.scalars(query)).all())
    more = len(rows) > limit
    rows = rows[:limit]
    return PromptPage(
        prompts=[
            PromptPassRecord(
                prompt_id=row.prompt_id,
                pass_=row.pass_,
                attempt=row.attempt,
                state=row.state,
                tries=row.tries,
            )
            for row in rows
        ],
        next_cursor=_encode_prompt_cursor(rows[-1].prompt_id, rows[-1].pass_) if more else None,
    )


async def dead_letters(
    session: AsyncSession, stream: EventStream, run_id: str, *, limit: int, cursor: str | None
) -> DeadLetterPage:
    """The run's dead-letter stream, oldest first."""
    await _require_run(session, stream, run_id)
    if cursor is not None:
        try:
            StreamId.parse(cursor)
        except EventError:
            raise BadRequest("invalid cursor") from None
    records = await stream.dead_letters(run_id, after=cursor, count=limit + 1)
    more = len(records) > limit
    records = records[:limit]
    page = []
    for record in records:
        event = record.fields.get(b"e")
        payload = record.fields.get(b"d")
        page.append(
            DeadLetter(
                dead_id=record.dead_id,
                stream_id=record.stream_id,
                event=event.decode("utf-8", "replace") if event is not None else None,
                payload=base64.b64encode(payload).decode() if payload is not None else None,
                error=record.error,
                deliveries=record.deliveries,
                consumer=record.consumer,
                dead_at=datetime.fromtimestamp(record.dead_at_ms / 1000, tz=UTC),
            )
        )
    return DeadLetterPage(
        count=await stream.dead_letter_count(run_id),
        dead_letters=page,
        next_cursor=records[-1].dead_id if more else None,
    )
