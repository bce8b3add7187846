"""SQLAlchemy models of the accounting tables; the Alembic migrations create exactly these."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    Index,
    Numeric,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from app.accounting.passes import PASS_RANK
from app.db import Base

__all__ = [
    "Batch",
    "ConsumerTotals",
    "GeneratorTotals",
    "LagCount",
    "LengthCount",
    "ProcessedEvent",
    "PromptMean",
    "PromptPass",
    "ReasonTotals",
    "RewardLatencyCount",
    "Run",
    "RunTotals",
    "TrainingTotals",
    "VersionTotals",
]


def _count() -> Mapped[int]:
    return mapped_column(BigInteger, nullable=False, server_default="0")


def _sum() -> Mapped[float]:
    return mapped_column(Double, nullable=False, server_default="0")


class Run(Base):
    """The newest snapshot of each run, from its ``run`` events."""

    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    policy_version: Mapped[int] = mapped_column(BigInteger, nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    last_change: Mapped[str] = mapped_column(Text, nullable=False)
    # Stream id of the snapshot's event: an older event never overwrites a newer one.
    event_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    event_seq: Mapped[int] = mapped_column(BigInteger, nullable=False)


class _Totals:
    """Counters shared by the per-run and per-version totals (see app.accounting.deltas)."""

    rollouts_received: Mapped[int] = _count()
    groups_received: Mapped[int] = _count()
    tokens_generated: Mapped[int] = _count()
    rollouts_rejected: Mapped[int] = _count()
    rollouts_leased: Mapped[int] = _count()
    rollouts_acked: Mapped[int] = _count()
    rollouts_nacked: Mapped[int] = _count()
    rollouts_expired: Mapped[int] = _count()
    rollouts_retired: Mapped[int] = _count()
    tokens_consumed: Mapped[int] = _count()
    wasted_tokens: Mapped[int] = _count()
    lag_samples: Mapped[int] = _count()
    # Σ lag over the samples: lags go up to 2^53, so a BIGINT could overflow (exact numeric).
    lag_sum: Mapped[int] = mapped_column(
        Numeric(precision=38, scale=0), nullable=False, server_default="0"
    )
    lag_max: Mapped[int | None] = mapped_column(BigInteger)
    kl_tokens: Mapped[int] = _count()
    kl_sum: Mapped[float] = _sum()
    kl_max: Mapped[float | None] = mapped_column(Double)
    tokens_masked: Mapped[int] = _count()
    tokens_masked_stale: Mapped[int] = _count()
    # Σ over the trained tokens of the samples of each token's own lag (exact numeric, as lag_sum).
    lag_token_sum: Mapped[int] = mapped_column(
        Numeric(precision=38, scale=0), nullable=False, server_default="0"
    )
    # Uses a rewind gave back (still counted in rollouts_acked: the gradients happened).
    samples_rewound: Mapped[int] = _count()
    # Rollouts posted without a reward: awaiting a reward lease, in a live one (both net sums of
    # the moves), scored through the API, and expiries of reward leases (one per rollout each).
    rewards_awaiting: Mapped[int] = _count()
    rewards_leased: Mapped[int] = _count()
    rewards_scored: Mapped[int] = _count()
    rewards_timed_out: Mapped[int] = _count()


class RunTotals(_Totals, Base):
    """One row per run: every counter of the accounting, summed over the drained events."""

    __tablename__ = "run_totals"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    duplicates: Mapped[int] = _count()
    batches_leased: Mapped[int] = _count()
    batches_acked: Mapped[int] = _count()
    batches_nacked: Mapped[int] = _count()
    batches_expired: Mapped[int] = _count()
    ratio_tokens: Mapped[int] = _count()
    ratio_sum: Mapped[float] = _sum()
    ratio_clipped: Mapped[int] = _count()
    events_applied: Mapped[int] = _count()
    first_event_ms: Mapped[int | None] = mapped_column(BigInteger)
    last_event_ms: Mapped[int | None] = mapped_column(BigInteger)
    # Prompt passes: Σ passes of the `registered` events, counted apart from the ledger rows
    # so that registered == queued + in_flight + done + failed checks one against the other.
    prompts_registered: Mapped[int] = _count()
    # Rows of prompt_passes per state, and Σ (attempt - 1) over them; kept by the repository
    # from each row's change, so reading them does not scan the ledger.
    prompts_queued: Mapped[int] = _count()
    prompts_in_flight: Mapped[int] = _count()
    prompts_done: Mapped[int] = _count()
    prompts_failed: Mapped[int] = _count()
    prompts_retried: Mapped[int] = _count()
    # Time long polls waited: trainers for rollouts, generators for prompts or budget.
    trainer_wait_ms: Mapped[int] = _count()
    generator_wait_ms: Mapped[int] = _count()
    # Σ ingest → score over the scored rollouts (ms).
    reward_wait_ms: Mapped[int] = _count()
    # Partial rollouts: returned, resumed and dropped, and the tokens of the last two.
    partials_returned: Mapped[int] = _count()
    partials_resumed: Mapped[int] = _count()
    partials_dropped: Mapped[int] = _count()
    partial_tokens_resumed: Mapped[int] = _count()
    partial_tokens_dropped: Mapped[int] = _count()
    # β after the newest ack and that ack's stream id: an older ack never overwrites it;
    # null β with an id: the newest ack carried none (the penalty off).
    kl_coef: Mapped[float | None] = mapped_column(Double)
    kl_coef_ms: Mapped[int | None] = mapped_column(BigInteger)
    kl_coef_seq: Mapped[int | None] = mapped_column(BigInteger)
    # The bias figures (SPEC "Accounting"): rewards of the rollouts received (posted with one,
    # or scored later) and of the samples consumed, counted and summed; their lengths are in
    # length_counts. Prompt passes skipped (a pool of weight 0) and cancelled (their run closed):
    # final states of the ledger.
    reward_generated_n: Mapped[int] = _count()
    reward_generated_sum: Mapped[float] = _sum()
    reward_trained_n: Mapped[int] = _count()
    reward_trained_sum: Mapped[float] = _sum()
    prompts_skipped: Mapped[int] = _count()
    prompts_cancelled: Mapped[int] = _count()


class VersionTotals(_Totals, Base):
    """One row per (run, policy version of the rollouts)."""

    __tablename__ = "version_totals"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    policy_version: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class TrainingTotals(Base):
    """One row per (run, policy version of the trainer): the acknowledged batches leased at
    that version V, and the exact KL and importance-ratio sums of their acks."""

    __tablename__ = "training_totals"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    policy_version: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    batches: Mapped[int] = _count()
    samples: Mapped[int] = _count()
    tokens: Mapped[int] = _count()
    kl_tokens: Mapped[int] = _count()
    kl_sum: Mapped[float] = _sum()
    kl_max: Mapped[float | None] = mapped_column(Double)
    ratio_tokens: Mapped[int] = _count()
    ratio_sum: Mapped[float] = _sum()
    ratio_clipped: Mapped[int] = _count()
    # β after the newest ack at this version and that ack's stream id: an older ack never
    # overwrites it; null β with an id: the newest ack carried none (the penalty off).
    kl_coef: Mapped[float | None] = mapped_column(Double)
    kl_coef_ms: Mapped[int | None] = mapped_column(BigInteger)
    kl_coef_seq: Mapped[int | None] = mapped_column(BigInteger)


class GeneratorTotals(Base):
    """One row per (run, generator_id): its rollouts received, their uses and the sums of
    their measured tokens, and whether it is quarantined (as the newest ``generator`` event
    told, with that event's stream id)."""

    __tablename__ = "generator_totals"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    generator_id: Mapped[str] = mapped_column(Text, primary_key=True)
    rollouts: Mapped[int] = _count()
    tokens: Mapped[int] = _count()
    samples_consumed: Mapped[int] = _count()
    kl_tokens: Mapped[int] = _count()
    kl_sum: Mapped[float] = _sum()
    kl_max: Mapped[float | None] = mapped_column(Double)
    ratio_tokens: Mapped[int] = _count()
    ratio_sum: Mapped[float] = _sum()
    clipped: Mapped[int] = _count()
    zero_weight: Mapped[int] = _count()
    last_seen_ms: Mapped[int | None] = mapped_column(BigInteger)
    quarantined: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    quarantined_ms: Mapped[int | None] = mapped_column(BigInteger)
    quarantined_seq: Mapped[int | None] = mapped_column(BigInteger)


class ConsumerTotals(Base):
    """One row per (run, consumer name): the items delivered to it, acknowledged and dropped,
    summed from ``consumers`` events. A consumer deleted and created again under the same name
    keeps adding to its row."""

    __tablename__ = "consumer_totals"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    delivered: Mapped[int] = _count()
    acked: Mapped[int] = _count()
    dropped: Mapped[int] = _count()


class ReasonTotals(Base):
    """Rejections and retirements by reason, per (run, policy version)."""

    __tablename__ = "reason_totals"
    __table_args__ = (CheckConstraint("kind IN ('rejected', 'retired')", name="kind"),)

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    policy_version: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    kind: Mapped[str] = mapped_column(Text, primary_key=True)
    reason: Mapped[str] = mapped_column(Text, primary_key=True)
    rollouts: Mapped[int] = _count()
    tokens: Mapped[int] = _count()
    unused: Mapped[int] = _count()
    wasted_tokens: Mapped[int] = _count()


class LagCount(Base):
    """The lag histogram: samples (acknowledged uses) per (run, rollout version, lag)."""

    __tablename__ = "lag_counts"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    policy_version: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    lag: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    samples: Mapped[int] = _count()


class RewardLatencyCount(Base):
    """The reward-latency histogram (ingest → score): scores per (run, bucket), each bucket
    named by its upper bound in ms (app.accounting.deltas.REWARD_LATENCY_BOUNDS_MS), counts not
    cumulative; a score beyond the last bound is in no row, only in the run's totals."""

    __tablename__ = "reward_latency_counts"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    bound_ms: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    scores: Mapped[int] = _count()


class LengthCount(Base):
    """The length histograms of the bias figures: per (run, side, bucket) the rollouts received
    (``generated``) or samples consumed (``trained``) whose trained-token length is in the
    bucket (app.accounting.bias: log-spaced, four a doubling)."""

    __tablename__ = "length_counts"
    __table_args__ = (CheckConstraint("side IN ('generated', 'trained')", name="side"),)

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    side: Mapped[str] = mapped_column(Text, primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rollouts: Mapped[int] = _count()


class PromptMean(Base):
    """Each prompt's reward history: the mean reward of its newest completed group (by the
    stream id of the ``prompt_scored`` event that told it: an older one never overwrites it)
    and how many groups were told. Its difficulty pool is judged from the mean and the run's
    thresholds when read."""

    __tablename__ = "prompt_means"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    prompt_id: Mapped[str] = mapped_column(Text(collation="C"), primary_key=True)
    mean: Mapped[float] = mapped_column(Double, nullable=False)
    groups: Mapped[int] = _count()
    event_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    event_seq: Mapped[int] = mapped_column(BigInteger, nullable=False)


class Batch(Base):
    """The batch ledger: one row per leased batch and its outcome."""

    __tablename__ = "batches"
    __table_args__ = (
        CheckConstraint("outcome IN ('leased', 'acked', 'nacked', 'expired')", name="outcome"),
        Index(None, "run_id", "event_ms", "event_seq", "batch_id"),
    )

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    batch_id: Mapped[str] = mapped_column(Text, primary_key=True)
    outcome: Mapped[str] = mapped_column(Text, nullable=False)
    trainer_id: Mapped[str | None] = mapped_column(Text)
    policy_version: Mapped[int | None] = mapped_column(BigInteger)
    leased_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    acked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    nacked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    size: Mapped[int | None] = mapped_column(BigInteger)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    lag_mean: Mapped[float | None] = mapped_column(Double)
    lag_max: Mapped[int | None] = mapped_column(BigInteger)
    samples: Mapped[int | None] = mapped_column(BigInteger)
    kl_mean: Mapped[float | None] = mapped_column(Double)
    kl_max: Mapped[float | None] = mapped_column(Double)
    is_ratio_mean: Mapped[float | None] = mapped_column(Double)
    clip_fraction: Mapped[float | None] = mapped_column(Double)
    ess_fraction: Mapped[float | None] = mapped_column(Double)
    step: Mapped[int | None] = mapped_column(BigInteger)
    # When a rewind undid the batch (it stays acked: its gradient happened).
    rewound_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Stream id of the batch's first event (its lease): the ledger's order and cursor.
    event_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    event_seq: Mapped[int] = mapped_column(BigInteger, nullable=False)


PASS_STATES = tuple(PASS_RANK)


class PromptPass(Base):
    """The prompt ledger: one row per pass of a prompt, in its newest state.

    A pass's states are ordered by (attempt, rank of state), queued < in_flight < done/failed
    within an attempt; the row keeps the greatest one whatever order its events are applied in
    (see app.accounting.passes.PassState).
    """

    __tablename__ = "prompt_passes"
    __table_args__ = (
        CheckConstraint(
            "state IN (" + ", ".join(f"'{s}'" for s in PASS_STATES) + ")", name="state"
        ),
        CheckConstraint('"pass" >= 1 AND attempt >= 1 AND tries >= 0', name="positive"),
        # Paging one state in (prompt_id, pass) order.
        Index(None, "run_id", "state", "prompt_id", "pass"),
    )

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    # Bytewise order ("C"), so the listing's order and cursor do not depend on the locale.
    prompt_id: Mapped[str] = mapped_column(Text(collation="C"), primary_key=True)
    pass_: Mapped[int] = mapped_column("pass", BigInteger, primary_key=True)
    attempt: Mapped[int] = mapped_column(BigInteger, nullable=False)
    state: Mapped[str] = mapped_column(Text, nullable=False)
    tries: Mapped[int] = _count()
    # Time of the event that put the pass in its state (the earliest, if several said so).
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class ProcessedEvent(Base):
    """Every applied stream entry: the key that makes draining exactly-once."""

    __tablename__ = "processed_events"

    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    stream_ms: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    stream_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    event_type: Mapped[str] = mapped_column(Text, nullable=False)
    applied_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
