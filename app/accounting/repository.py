"""All writes of the accounting: record events idempotently, then apply only the new ones.

The caller owns the transaction: :func:`apply_events` must run inside one, so that the event
ids and the totals they produced commit together or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import ColumnElement, Row, Table, case, func, select, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from app.accounting.deltas import (
    BATCH_VALUE_FIELDS,
    MAX_COLUMNS,
    MIN_COLUMNS,
    NEWEST_GROUPS,
    ConsumerDelta,
    Fold,
    GeneratorDelta,
    PromptMeanDelta,
    TotalsDelta,
    TrainingDelta,
)
from app.accounting.fold import fold_events
from app.accounting.models import (
    Batch,
    ConsumerTotals,
    GeneratorTotals,
    LagCount,
    LengthCount,
    ProcessedEvent,
    PromptMean,
    PromptPass,
    ReasonTotals,
    RewardLatencyCount,
    Run,
    RunTotals,
    TrainingTotals,
    VersionTotals,
)
from app.accounting.passes import PASS_RANK, PassCounts, PassState
from app.db import Base
from app.events import Event, StreamId

__all__ = ["ApplyResult", "apply_events", "apply_fold", "processed_ids", "record_events"]

# Keep multi-row statements well below asyncpg's 32767 bind parameters.
_ROWS_PER_STATEMENT = 1000


@dataclass(frozen=True, slots=True)
class ApplyResult:
    applied: int
    already: int


def ms_to_datetime(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)


def _chunks(rows: Sequence[dict[str, Any]]) -> Iterable[Sequence[dict[str, Any]]]:
    for start in range(0, len(rows), _ROWS_PER_STATEMENT):
        yield rows[start : start + _ROWS_PER_STATEMENT]


async def record_events(
    session: AsyncSession, run_id: str, events: Sequence[Event]
) -> set[StreamId]:
    """Insert the events' ids; return those that were not there before."""
    rows = [
        {
            "run_id": run_id,
            "stream_ms": e.stream_id.ms,
            "stream_seq": e.stream_id.seq,
            "event_type": e.type,
        }
        for e in sorted({e.stream_id: e for e in events}.values(), key=lambda e: e.stream_id)
    ]
    new: set[StreamId] = set()
    for chunk in _chunks(rows):
        stmt = (
            insert(ProcessedEvent)
            .values(list(chunk))
            .on_conflict_do_nothing(index_elements=["run_id", "stream_ms", "stream_seq"])
            .returning(ProcessedEvent.stream_ms, ProcessedEvent.stream_seq)
        )
        result = await session.execute(stmt)
        new.update(StreamId(ms, seq) for ms, seq in result.all())
    return new


async def processed_ids(session: AsyncSession, run_id: str) -> set[StreamId]:
    """Every applied event id of a run (diagnostics and tests)."""
    result = await session.execute(
        select(ProcessedEvent.stream_ms, ProcessedEvent.stream_seq).where(
            ProcessedEvent.run_id == run_id
        )
    )
    return {StreamId(ms, seq) for ms, seq in result.all()}


async def apply_events(session: AsyncSession, run_id: str, events: Sequence[Event]) -> ApplyResult:
    """Record the events and fold the newly recorded ones into the totals (one transaction)."""
    new = await record_events(session, run_id, events)
    fresh = [e for e in events if e.stream_id in new]
    # An id seen twice in one call is applied once.
    unique = list({e.stream_id: e for e in fresh}.values())
    if unique:
        await apply_fold(session, run_id, fold_events(unique))
    return ApplyResult(applied=len(unique), already=len(events) - len(unique))


# Each column of a NEWEST_GROUPS group -> the (ms, seq) columns of the event that told it.
_TOLD_BY = {name: told_by for value, told_by in NEWEST_GROUPS.items() for name in (value, *told_by)}


def _newer(table: Table, excluded: Any, told_by: tuple[str, str]) -> ColumnElement[bool]:
    """The incoming row was told by a newer event than the stored one (or the stored one by
    none); an incoming row told by none is never newer."""
    ms, seq = told_by
    newer: ColumnElement[bool] = excluded[ms].is_not(None) & (
        table.c[ms].is_(None)
        | (tuple_(table.c[ms], table.c[seq]) < tuple_(excluded[ms], excluded[seq]))
    )
    return newer


def _merge_set(
    table: Table, excluded: Any, columns: Iterable[str]
) -> dict[str, ColumnElement[Any]]:
    merged: dict[str, ColumnElement[Any]] = {}
    for name in columns:
        current, incoming = table.c[name], excluded[name]
        if name in _TOLD_BY:
            merged[name] = case((_newer(table, excluded, _TOLD_BY[name]), incoming), else_=current)
        elif name in MAX_COLUMNS:
            # GREATEST/LEAST ignore NULLs in Postgres.
            merged[name] = func.greatest(current, incoming)
        elif name in MIN_COLUMNS:
            merged[name] = func.least(current, incoming)
        else:
            merged[name] = current + incoming
    return merged


async def _upsert_add(
    session: AsyncSession, table: Table, keys: Sequence[str], rows: Sequence[dict[str, Any]]
) -> None:
    if not rows:
        return
    values = [name for name in rows[0] if name not in keys]
    for chunk in _chunks(rows):
        stmt = insert(table).values(list(chunk))
        stmt = stmt.on_conflict_do_update(
            index_elements=list(keys), set_=_merge_set(table, stmt.excluded, values)
        )
        await session.execute(stmt)


def _table(model: type[Base]) -> Table:
    return cast(Table, model.__table__)


def _totals_row(
    delta: TotalsDelta
    | TrainingDelta
    | PassCounts
    | GeneratorDelta
    | PromptMeanDelta
    | ConsumerDelta,
) -> dict[str, Any]:
    return {f.name: getattr(delta, f.name) for f in fields(delta)}


async def apply_fold(session: AsyncSession, run_id: str, fold: Fold) -> None:
    """Add one batch's deltas to the tables; rows are touched in key order to avoid deadlocks
    between workers that apply batches of the same run concurrently."""
    if fold.snapshot is not None:
        await _upsert_run(session, run_id, fold)
    counts = await _upsert_passes(session, run_id, fold.passes)
    await _upsert_add(
        session,
        _table(RunTotals),
        ["run_id"],
        [{"run_id": run_id, **_totals_row(fold.run), **_totals_row(counts)}],
    )
    # Rows keyed by the run and one more column, each with its delta's fields.
    keyed: tuple[tuple[type[Base], str, Mapping[Any, Any]], ...] = (
        (VersionTotals, "policy_version", fold.versions),
        (TrainingTotals, "policy_version", fold.trainings),
        (GeneratorTotals, "generator_id", fold.generators),
        (PromptMean, "prompt_id", fold.means),
        (ConsumerTotals, "name", fold.consumers),
    )
    for model, key, deltas in keyed:
        rows = [{"run_id": run_id, key: k, **_totals_row(deltas[k])} for k in sorted(deltas)]
        await _upsert_add(session, _table(model), ["run_id", key], rows)
    await _upsert_add(
        session,
        _table(ReasonTotals),
        ["run_id", "policy_version", "kind", "reason"],
        [
            {
                "run_id": run_id,
                "policy_version": version,
                "kind": kind,
                "reason": reason,
                "rollouts": delta.rollouts,
                "tokens": delta.tokens,
                "unused": delta.unused,
                "wasted_tokens": delta.wasted_tokens,
            }
            for (version, kind, reason), delta in sorted(fold.reasons.items())
        ],
    )
    await _upsert_histograms(session, run_id, fold)
    await _upsert_batches(session, run_id, fold)


async def _upsert_histograms(session: AsyncSession, run_id: str, fold: Fold) -> None:
    """The histograms' rows: lags, reward latencies and the bias figures' lengths."""
    await _upsert_add(
        session,
        _table(LagCount),
        ["run_id", "policy_version", "lag"],
        [
            {"run_id": run_id, "policy_version": version, "lag": lag, "samples": samples}
            for (version, lag), samples in sorted(fold.lags.items())
        ],
    )
    await _upsert_add(
        session,
        _table(RewardLatencyCount),
        ["run_id", "bound_ms"],
        [
            {"run_id": run_id, "bound_ms": bound, "scores": scores}
            for bound, scores in sorted(fold.reward_latency.items())
        ],
    )
    await _upsert_add(
        session,
        _table(LengthCount),
        ["run_id", "side", "bucket"],
        [
            {"run_id": run_id, "side": side, "bucket": bucket, "rollouts": rollouts}
            for (side, bucket), rollouts in sorted(fold.lengths.items())
        ],
    )


async def _upsert_run(session: AsyncSession, run_id: str, fold: Fold) -> None:
    snap = fold.snapshot
    assert snap is not None
    stmt = insert(Run).values(
        run_id=run_id,
        config=snap.config,
        policy_version=snap.policy_version,
        status=snap.status,
        created_at=ms_to_datetime(snap.created_at_ms),
        updated_at=ms_to_datetime(snap.t_ms),
        last_change=snap.change,
        event_ms=snap.stream_id.ms,
        event_seq=snap.stream_id.seq,
    )
    columns = (
        "config",
        "policy_version",
        "status",
        "created_at",
        "updated_at",
        "last_change",
        "event_ms",
        "event_seq",
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id"],
        set_={name: stmt.excluded[name] for name in columns},
        # The newest snapshot wins, whatever order batches are applied in.
        where=tuple_(Run.event_ms, Run.event_seq)
        < tuple_(stmt.excluded.event_ms, stmt.excluded.event_seq),
    )
    await session.execute(stmt)


_BATCH_TIMES = {
    "leased_at_ms": "leased_at",
    "expires_at_ms": "expires_at",
    "acked_at_ms": "acked_at",
    "nacked_at_ms": "nacked_at",
    "expired_at_ms": "expired_at",
    "rewound_at_ms": "rewound_at",
}


async def _upsert_batches(session: AsyncSession, run_id: str, fold: Fold) -> None:
    if not fold.batches:
        return
    rows = []
    for batch_id in sorted(fold.batches):
        patch = fold.batches[batch_id]
        row: dict[str, Any] = {
            "run_id": run_id,
            "batch_id": batch_id,
            "outcome": patch.outcome,
            "event_ms": patch.first_event.ms,
            "event_seq": patch.first_event.seq,
        }
        for name in BATCH_VALUE_FIELDS:
            value = getattr(patch, name)
            if name in _BATCH_TIMES:
                row[_BATCH_TIMES[name]] = ms_to_datetime(value)
            else:
                row[name] = value
        rows.append(row)
    table = _table(Batch)
    value_columns = [_BATCH_TIMES.get(name, name) for name in BATCH_VALUE_FIELDS]
    for chunk in _chunks(rows):
        stmt = insert(table).values(list(chunk))
        ex = stmt.excluded
        earlier = tuple_(ex.event_ms, ex.event_seq) < tuple_(table.c.event_ms, table.c.event_seq)
        set_: dict[str, ColumnElement[Any]] = {
            name: func.coalesce(ex[name], table.c[name]) for name in value_columns
        }
        set_["rewound_at"] = func.least(ex.rewound_at, table.c.rewound_at)  # as BatchPatch.merge
        # A terminal outcome (acked/nacked/expired) is never replaced by "leased".
        set_["outcome"] = case((ex.outcome == "leased", table.c.outcome), else_=ex.outcome)
        set_["event_ms"] = case((earlier, ex.event_ms), else_=table.c.event_ms)
        set_["event_seq"] = case((earlier, ex.event_seq), else_=table.c.event_seq)
        stmt = stmt.on_conflict_do_update(index_elements=["run_id", "batch_id"], set_=set_)
        await session.execute(stmt)


def _rank(state: ColumnElement[str]) -> ColumnElement[int]:
    """PASS_RANK in SQL."""
    ranks = {name: rank for name, rank in PASS_RANK.items() if rank < max(PASS_RANK.values())}
    return case(ranks, value=state, else_=max(PASS_RANK.values()))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _pass_key(row: Row[*tuple[Any, ...]]) -> tuple[str, int]:
    return row.prompt_id, row._mapping["pass"]


def _pass_state(row: Row[*tuple[Any, ...]]) -> PassState:
    t_ms = (row.updated_at - _EPOCH) // timedelta(milliseconds=1)
    return PassState(row.attempt, row.state, row.tries, t_ms)


async def _upsert_passes(
    session: AsyncSession, run_id: str, passes: dict[tuple[str, int], PassState]
) -> PassCounts:
    """Merge the passes' states into the ledger (PassState.merge, in SQL) and return how the
    run's per-state counters change.

    The counters need each changed row's state before and after. New rows are inserted first
    (``ON CONFLICT DO NOTHING``: a row another transaction is inserting is waited for, then
    counts as known); known rows are then read ``FOR UPDATE``, so no other transaction moves
    them between that read and the merge, which only writes (and returns) rows it changes.
    Both steps go in key order, as everything else here does.
    """
    counts = PassCounts()
    table = _table(PromptPass)
    c = table.c
    rows = [
        {
            "run_id": run_id,
            "prompt_id": prompt_id,
            "pass": pass_,
            "attempt": state.attempt,
            "state": state.state,
            "tries": state.tries,
            "updated_at": ms_to_datetime(state.t_ms),
        }
        for (prompt_id, pass_), state in sorted(passes.items())
    ]
    for chunk in _chunks(rows):
        inserted = await session.execute(
            insert(table)
            .values(list(chunk))
            .on_conflict_do_nothing(index_elements=["run_id", "prompt_id", "pass"])
            .returning(c.prompt_id, c["pass"])
        )
        new = {(prompt_id, pass_) for prompt_id, pass_ in inserted.all()}
        for key in sorted(new):
            counts.move(None, passes[key])
        known = [row for row in chunk if (row["prompt_id"], row["pass"]) not in new]
        if not known:
            continue
        locked = await session.execute(
            select(c.prompt_id, c["pass"], c.attempt, c.state, c.tries, c.updated_at)
            .where(
                c.run_id == run_id,
                tuple_(c.prompt_id, c["pass"]).in_([(r["prompt_id"], r["pass"]) for r in known]),
            )
            .order_by(c.prompt_id, c["pass"])
            .with_for_update()
        )
        before = {_pass_key(row): _pass_state(row) for row in locked.all()}
        upsert = insert(table).values(known)
        ex = upsert.excluded
        theirs = tuple_(ex.attempt, _rank(ex.state), ex.state)
        mine = tuple_(c.attempt, _rank(c.state), c.state)
        newer, same = mine < theirs, mine == theirs
        merge = upsert.on_conflict_do_update(
            index_elements=["run_id", "prompt_id", "pass"],
            set_={
                "attempt": case((newer, ex.attempt), else_=c.attempt),
                "state": case((newer, ex.state), else_=c.state),
                "tries": func.greatest(c.tries, ex.tries),
                "updated_at": case(
                    (newer, ex.updated_at),
                    (same, func.least(c.updated_at, ex.updated_at)),
                    else_=c.updated_at,
                ),
            },
            # Only rows that change are written, and only they are returned.
            where=newer | (ex.tries > c.tries) | (same & (ex.updated_at < c.updated_at)),
        ).returning(c.prompt_id, c["pass"], c.attempt, c.state, c.tries, c.updated_at)
        for row in (await session.execute(merge)).all():
            counts.move(before[_pass_key(row)], _pass_state(row))
    return counts
