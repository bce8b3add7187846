"""Read side of the accounting's totals, for the operator API and the metrics: a run's totals
(with the check of its ledger, app/accounting/ledger.py), its rows per version of the rollouts
and per version of the trainer. The listings (batch ledger, prompt ledger, dead letters) are in
app/accounting/listings.py."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.accounting.bias import bias_stats
from app.accounting.consumer_figures import consumers_of
from app.accounting.ledger import (
    LedgerCheck,
    Settled,
    check_of,
    ledger_counts,
    live_counts,
    one_snapshot,
    read_once,
    read_settled,
    zero_totals,
)
from app.accounting.models import (
    GeneratorTotals,
    LagCount,
    LengthCount,
    ReasonTotals,
    RewardLatencyCount,
    Run,
    RunTotals,
    TrainingTotals,
    VersionTotals,
)
from app.accounting.pools import queued_pools, queued_pools_of
from app.accounting.repository import ms_to_datetime
from app.accounting.schemas import (
    BatchCounts,
    ConsumerCounts,
    GeneratorAccounting,
    GeneratorsAccounting,
    IsRatioStats,
    KlStats,
    LagStats,
    PartialCounts,
    PoolCounts,
    PromptCounts,
    RewardCounts,
    RunAccounting,
    TrainingAccounting,
    TrainingVersion,
    VersionAccounting,
    VersionsAccounting,
    WaitStats,
)
from app.accounting.stream import EventStream
from app.errors import RunNotFound

__all__ = [
    "CheckedAccounting",
    "checked_accounting",
    "checked_accounting_of",
    "generator_accounting",
    "generator_answer",
    "require_run",
    "run_accounting",
    "training_accounting",
    "version_accounting",
]


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


async def require_run(session: AsyncSession, stream: EventStream, run_id: str) -> None:
    """A run is known once any of its events is drained, or while it exists in Redis only."""
    if await session.get(RunTotals, run_id) is not None:
        return
    if await session.get(Run, run_id) is not None:
        return
    if await stream.run_exists(run_id):
        return
    raise RunNotFound(f"run {run_id!r} does not exist")


async def _start_read(
    session: AsyncSession, stream: EventStream, run_id: str
) -> tuple[int, RunTotals | None]:
    """The start of every per-part read of a run's accounting: its pending events (first, as in
    run_accounting), one snapshot for the rest of the read, and its totals (None before its
    first drained event); RunNotFound for a run neither the ledger nor Redis knows."""
    pending = await stream.pending_events(run_id)
    await one_snapshot(session)
    totals = await session.get(RunTotals, run_id)
    if totals is None:
        await require_run(session, stream, run_id)
    return pending, totals


Reasons = dict[int, dict[str, dict[str, int]]]  # policy_version -> kind -> reason -> rollouts
Lags = dict[int, dict[int, int]]  # policy_version -> lag -> samples
Lengths = dict[str, dict[int, int]]  # side -> bucket -> rollouts


async def _reasons(session: AsyncSession, run_id: str) -> Reasons:
    return (await _reasons_of(session, [run_id])).get(run_id, {})


async def _reasons_of(session: AsyncSession, run_ids: Sequence[str]) -> dict[str, Reasons]:
    columns = ("policy_version", "kind", "reason", "rollouts")
    return await _counts_of(session, run_ids, ReasonTotals, *columns)


async def _lags(session: AsyncSession, run_id: str) -> Lags:
    return (await _lags_of(session, [run_id])).get(run_id, {})


async def _counts_of(
    session: AsyncSession, run_ids: Sequence[str], table: Any, *columns: str
) -> dict[str, Any]:
    """A histogram table's rows of several runs, nested by run and then by each of ``columns``
    but the last, which is the count: ``{run_id: {key: ... {last key: count}}}``."""
    *keys, count = (getattr(table, c) for c in columns)
    rows = await session.execute(
        select(table.run_id, *keys, count)
        .where(table.run_id.in_(run_ids))
        .order_by(table.run_id, *keys)
    )
    result: dict[str, Any] = {}
    for run_id, *path, n in rows.all():
        at = result.setdefault(run_id, {})
        for key in path[:-1]:
            at = at.setdefault(key, {})
        at[path[-1]] = n
    return result


async def _lags_of(session: AsyncSession, run_ids: Sequence[str]) -> dict[str, Lags]:
    return await _counts_of(session, run_ids, LagCount, "policy_version", "lag", "samples")


async def _reward_latency_of(
    session: AsyncSession, run_ids: Sequence[str]
) -> dict[str, dict[int, int]]:
    return await _counts_of(session, run_ids, RewardLatencyCount, "bound_ms", "scores")


async def _lengths_of(session: AsyncSession, run_ids: Sequence[str]) -> dict[str, Lengths]:
    return await _counts_of(session, run_ids, LengthCount, "side", "bucket", "rollouts")


async def _generators_of(
    session: AsyncSession, run_ids: Sequence[str]
) -> dict[str, list[GeneratorTotals]]:
    rows = await session.scalars(
        select(GeneratorTotals)
        .where(GeneratorTotals.run_id.in_(run_ids))
        .order_by(GeneratorTotals.run_id, GeneratorTotals.generator_id)
    )
    result: dict[str, list[GeneratorTotals]] = defaultdict(list)
    for row in rows.all():
        result[row.run_id].append(row)
    return result


async def _kl_coefs(session: AsyncSession, run_id: str) -> dict[int, float | None]:
    """β after the newest ack at each version of the trainer."""
    rows = await session.execute(
        select(TrainingTotals.policy_version, TrainingTotals.kl_coef).where(
            TrainingTotals.run_id == run_id
        )
    )
    return {version: kl_coef for version, kl_coef in rows.all()}


def _sum_by_reason(per_version: dict[int, dict[str, dict[str, int]]], kind: str) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for kinds in per_version.values():
        for reason, n in kinds.get(kind, {}).items():
            total[reason] += n
    return dict(sorted(total.items()))


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
        "tokens_masked": totals.tokens_masked,
        "tokens_masked_stale": totals.tokens_masked_stale,
        "buffered": buffered,
        "leased": leased,
        "samples_consumed": totals.rollouts_acked,
        "samples_rewound": totals.samples_rewound,
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
            token_mean=float(Decimal(totals.lag_token_sum) / totals.tokens_consumed)
            if totals.tokens_consumed
            else None,
        ),
        "kl": KlStats(mean=_ratio(totals.kl_sum, totals.kl_tokens), max=totals.kl_max),
        "rewards": RewardCounts(
            awaiting=totals.rewards_awaiting,
            leased=totals.rewards_leased,
            scored=totals.rewards_scored,
            timed_out=totals.rewards_timed_out,
        ),
    }


@dataclass(frozen=True, slots=True)
class CheckedAccounting:
    """A run's accounting with the check of its ledger and its totals row, from one read."""

    accounting: RunAccounting
    check: LedgerCheck
    totals: RunTotals  # zeros when nothing was drained yet
    # The reward-latency histogram: bucket bound (ms) -> scores in it, not cumulative; the
    # scores beyond the last bound are in totals.rewards_scored only.
    reward_latency: dict[int, int]
    generators: Sequence[GeneratorTotals] = ()  # its generators' rows, by generator_id


async def run_accounting(session: AsyncSession, stream: EventStream, run_id: str) -> RunAccounting:
    return (await checked_accounting(session, stream, run_id)).accounting


async def checked_accounting(
    session: AsyncSession, stream: EventStream, run_id: str
) -> CheckedAccounting:
    """:func:`run_accounting`, and :func:`check_ledger` of the same read (``GET /metrics``)."""
    settled = await read_settled(session, stream, run_id)
    if settled.totals is None:
        await require_run(session, stream, run_id)
    latency = (await _reward_latency_of(session, [run_id])).get(run_id, {})
    reasons, lags = await _reasons(session, run_id), await _lags(session, run_id)
    generators = (await _generators_of(session, [run_id])).get(run_id, [])
    lengths = (await _lengths_of(session, [run_id])).get(run_id, {})
    pools = await queued_pools(session, run_id)
    consumers = (await consumers_of(session, [run_id])).get(run_id, {})
    return _checked(run_id, settled, reasons, lags, latency, generators, pools, lengths, consumers)


async def checked_accounting_of(
    session: AsyncSession, stream: EventStream, run_ids: Sequence[str]
) -> dict[str, CheckedAccounting]:
    """:func:`checked_accounting` of several runs, read together: one database snapshot and a
    few queries for all of them instead of several per run. A run deleted since it was named is
    left out; one whose read was not settled is read again on its own."""
    settled = await read_once(session, stream, run_ids)
    ready = [r for r in run_ids if settled[r].readable]
    reasons = await _reasons_of(session, ready)
    lags = await _lags_of(session, ready)
    latency = await _reward_latency_of(session, ready)
    generators = await _generators_of(session, ready)
    pools = await queued_pools_of(session, ready)
    lengths = await _lengths_of(session, ready)
    consumers = await consumers_of(session, ready)
    out: dict[str, CheckedAccounting] = {}
    for run_id in ready:
        try:
            if settled[run_id].totals is None:
                await require_run(session, stream, run_id)
        except RunNotFound:
            continue
        out[run_id] = _checked(
            run_id,
            settled[run_id],
            reasons.get(run_id, {}),
            lags.get(run_id, {}),
            latency.get(run_id, {}),
            generators.get(run_id, []),
            pools[run_id],
            lengths.get(run_id, {}),
            consumers.get(run_id, {}),
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


def _checked(
    run_id: str,
    settled: Settled,
    reasons: Reasons,
    lags: Lags,
    latency: dict[int, int],
    generators: Sequence[GeneratorTotals],
    pools: PoolCounts | None,
    lengths: Lengths,
    consumers: dict[str, ConsumerCounts],
) -> CheckedAccounting:
    totals = settled.totals or zero_totals()
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
        kl_coef=totals.kl_coef,
        prompts=PromptCounts(
            registered=totals.prompts_registered,
            queued=totals.prompts_queued,
            in_flight=totals.prompts_in_flight,
            # Skipped and cancelled passes are over too: in done, so that the passes still add up.
            done=totals.prompts_done + totals.prompts_skipped + totals.prompts_cancelled,
            failed=totals.prompts_failed,
            retried=totals.prompts_retried,
            skipped=totals.prompts_skipped,
            cancelled=totals.prompts_cancelled,
            pools=pools,
        ),
        partials=PartialCounts(
            returned=totals.partials_returned,
            resumed=totals.partials_resumed,
            dropped=totals.partials_dropped,
            tokens_resumed=totals.partial_tokens_resumed,
            tokens_dropped=totals.partial_tokens_dropped,
        ),
        wait=WaitStats(
            generator_s=totals.generator_wait_ms / 1000,
            trainer_s=totals.trainer_wait_ms / 1000,
            reward_s=totals.reward_wait_ms / 1000,
        ),
        bias=bias_stats(totals, lengths),
        as_of=ms_to_datetime(totals.last_event_ms),
        pending_events=settled.pending,
        dead_letters=settled.snapshot.dead_letters,
        live=live_counts(settled.snapshot),
        consumers=consumers,
    )
    return CheckedAccounting(
        accounting, check_of(run_id, settled), totals, latency, tuple(generators)
    )


async def version_accounting(
    session: AsyncSession, stream: EventStream, run_id: str
) -> VersionsAccounting:
    pending, totals = await _start_read(session, stream, run_id)
    rows = await session.scalars(
        select(VersionTotals)
        .where(VersionTotals.run_id == run_id)
        .order_by(VersionTotals.policy_version)
    )
    reasons = await _reasons(session, run_id)
    lags = await _lags(session, run_id)
    kl_coefs = await _kl_coefs(session, run_id)
    versions = [
        VersionAccounting(
            policy_version=row.policy_version,
            **_common(
                row,
                dict(reasons.get(row.policy_version, {}).get("rejected", {})),
                dict(reasons.get(row.policy_version, {}).get("retired", {})),
                lags.get(row.policy_version, {}),
            ),
            kl_coef=kl_coefs.get(row.policy_version),
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
    pending, _ = await _start_read(session, stream, run_id)
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
                kl_coef=row.kl_coef,
            )
            for row in rows.all()
        ],
        pending_events=pending,
    )


def generator_answer(row: GeneratorTotals) -> GeneratorAccounting:
    """A generator's figures from its row: means over its measured tokens, null with none."""
    return GeneratorAccounting(
        generator_id=row.generator_id,
        rollouts=row.rollouts,
        tokens=row.tokens,
        samples_consumed=row.samples_consumed,
        kl=KlStats(mean=_ratio(row.kl_sum, row.kl_tokens), max=row.kl_max),
        is_ratio=IsRatioStats(
            mean=_ratio(row.ratio_sum, row.ratio_tokens),
            clip_fraction=_ratio(row.clipped, row.ratio_tokens),
        ),
        masked_fraction=_ratio(row.zero_weight, row.ratio_tokens),
        last_seen=ms_to_datetime(row.last_seen_ms),
        quarantined=row.quarantined,
    )


async def generator_accounting(
    session: AsyncSession, stream: EventStream, run_id: str
) -> GeneratorsAccounting:
    """Per generator of the run's rollouts, by generator_id."""
    pending, totals = await _start_read(session, stream, run_id)
    rows = (await _generators_of(session, [run_id])).get(run_id, [])
    return GeneratorsAccounting(
        generators=[generator_answer(row) for row in rows],
        as_of=ms_to_datetime(totals.last_event_ms if totals is not None else None),
        pending_events=pending,
    )
