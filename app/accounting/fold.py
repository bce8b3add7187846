"""Folding of one run's newly drained events into additive deltas for the accounting tables.

Every delta is commutative (sums, maxima, minima, "newest snapshot wins"), so the order in
which workers apply batches of events does not change the result: a batch claimed from a dead
consumer may land after a later one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from app.accounting.events import (
    Accepted,
    Acked,
    Duplicate,
    Event,
    Leased,
    Rejected,
    Retired,
    Returned,
    RunChanged,
    StreamId,
    lag_of,
)

__all__ = [
    "BatchPatch",
    "Fold",
    "ReasonDelta",
    "RunSnapshot",
    "RunTotalsDelta",
    "TotalsDelta",
    "fold_events",
]

REJECTED = "rejected"
RETIRED = "retired"


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


@dataclass
class TotalsDelta:
    """Counters kept both per run and per (run, policy version of the rollouts)."""

    rollouts_received: int = 0
    groups_received: int = 0
    tokens_generated: int = 0
    rollouts_rejected: int = 0
    rollouts_leased: int = 0
    rollouts_acked: int = 0
    rollouts_nacked: int = 0
    rollouts_expired: int = 0
    rollouts_retired: int = 0
    tokens_consumed: int = 0
    wasted_tokens: int = 0
    lag_samples: int = 0
    lag_sum: int = 0
    lag_max: int | None = None
    kl_tokens: int = 0
    kl_sum: float = 0.0
    kl_max: float | None = None


@dataclass
class RunTotalsDelta(TotalsDelta):
    """Counters that only make sense per run (events carry no rollout version for them)."""

    duplicates: int = 0
    batches_leased: int = 0
    batches_acked: int = 0
    batches_nacked: int = 0
    batches_expired: int = 0
    ratio_tokens: int = 0
    ratio_sum: float = 0.0
    ratio_clipped: int = 0
    events_applied: int = 0
    first_event_ms: int | None = None
    last_event_ms: int | None = None


# Columns merged with GREATEST / LEAST instead of addition.
MAX_COLUMNS = frozenset({"lag_max", "kl_max", "last_event_ms"})
MIN_COLUMNS = frozenset({"first_event_ms"})


@dataclass
class ReasonDelta:
    """Rejections or retirements of one reason and rollout version."""

    rollouts: int = 0
    tokens: int = 0
    unused: int = 0
    wasted_tokens: int = 0


@dataclass
class BatchPatch:
    """What the events say about one batch; ``None`` = this batch's events did not say."""

    first_event: StreamId
    outcome: str = "leased"
    trainer_id: str | None = None
    policy_version: int | None = None
    leased_at_ms: int | None = None
    expires_at_ms: int | None = None
    acked_at_ms: int | None = None
    nacked_at_ms: int | None = None
    expired_at_ms: int | None = None
    size: int | None = None
    tokens: int | None = None
    lag_mean: float | None = None
    lag_max: int | None = None
    samples: int | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    is_ratio_mean: float | None = None
    clip_fraction: float | None = None
    ess_fraction: float | None = None
    step: int | None = None

    def merge(self, other: BatchPatch) -> None:
        """Fold a later event's patch into this one (terminal outcomes win over ``leased``)."""
        self.first_event = min(self.first_event, other.first_event)
        if other.outcome != "leased":
            self.outcome = other.outcome
        for name in BATCH_VALUE_FIELDS:
            value = getattr(other, name)
            if value is not None:
                setattr(self, name, value)


BATCH_VALUE_FIELDS = (
    "trainer_id",
    "policy_version",
    "leased_at_ms",
    "expires_at_ms",
    "acked_at_ms",
    "nacked_at_ms",
    "expired_at_ms",
    "size",
    "tokens",
    "lag_mean",
    "lag_max",
    "samples",
    "kl_mean",
    "kl_max",
    "is_ratio_mean",
    "clip_fraction",
    "ess_fraction",
    "step",
)


@dataclass
class RunSnapshot:
    """The run row after its newest ``run`` event in the batch."""

    stream_id: StreamId
    t_ms: int
    change: str
    config: dict[str, object]
    policy_version: int
    status: str
    created_at_ms: int


@dataclass
class Fold:
    """All deltas of one batch of one run's events."""

    run: RunTotalsDelta = field(default_factory=RunTotalsDelta)
    versions: dict[int, TotalsDelta] = field(default_factory=dict)
    reasons: dict[tuple[int, str, str], ReasonDelta] = field(default_factory=dict)
    lags: dict[tuple[int, int], int] = field(default_factory=dict)
    batches: dict[str, BatchPatch] = field(default_factory=dict)
    snapshot: RunSnapshot | None = None

    def version(self, policy_version: int) -> TotalsDelta:
        delta = self.versions.get(policy_version)
        if delta is None:
            delta = self.versions[policy_version] = TotalsDelta()
        return delta

    def reason(self, policy_version: int, kind: str, reason: str) -> ReasonDelta:
        key = (policy_version, kind, reason)
        delta = self.reasons.get(key)
        if delta is None:
            delta = self.reasons[key] = ReasonDelta()
        return delta

    def batch(self, patch: BatchPatch, batch_id: str) -> None:
        known = self.batches.get(batch_id)
        if known is None:
            self.batches[batch_id] = patch
        else:
            known.merge(patch)


def fold_events(events: Iterable[Event]) -> Fold:
    """Aggregate events (all of one run, none already applied) into table deltas."""
    fold = Fold()
    run = fold.run
    for event in events:
        run.events_applied += 1
        run.first_event_ms = (
            event.t_ms if run.first_event_ms is None else min(run.first_event_ms, event.t_ms)
        )
        run.last_event_ms = (
            event.t_ms if run.last_event_ms is None else max(run.last_event_ms, event.t_ms)
        )
        body = event.body
        if isinstance(body, RunChanged):
            _fold_run(fold, event, body)
        elif isinstance(body, Accepted):
            _fold_accepted(fold, body)
        elif isinstance(body, Duplicate):
            run.duplicates += body.n
        elif isinstance(body, Rejected):
            _fold_rejected(fold, body)
        elif isinstance(body, Leased):
            _fold_leased(fold, event, body)
        elif isinstance(body, Acked):
            _fold_acked(fold, event, body)
        elif isinstance(body, Returned):
            _fold_returned(fold, event, body)
        else:
            _fold_retired(fold, body)
    return fold


def _fold_run(fold: Fold, event: Event, body: RunChanged) -> None:
    if fold.snapshot is not None and fold.snapshot.stream_id > event.stream_id:
        return
    fold.snapshot = RunSnapshot(
        stream_id=event.stream_id,
        t_ms=event.t_ms,
        change=body.change,
        config=dict(body.config),
        policy_version=body.policy_version,
        status=body.status,
        created_at_ms=body.created_at_ms,
    )


def _fold_accepted(fold: Fold, body: Accepted) -> None:
    for item in body.items:
        for totals in (fold.run, fold.version(item.policy_version)):
            totals.rollouts_received += 1
            totals.groups_received += int(item.new_unit)
            totals.tokens_generated += item.tokens


def _fold_rejected(fold: Fold, body: Rejected) -> None:
    for item in body.items:
        fold.run.rollouts_rejected += 1
        fold.version(item.policy_version).rollouts_rejected += 1
        reason = fold.reason(item.policy_version, REJECTED, item.reason)
        reason.rollouts += 1
        reason.tokens += item.tokens


def _fold_leased(fold: Fold, event: Event, body: Leased) -> None:
    fold.run.batches_leased += 1
    for item in body.items:
        fold.run.rollouts_leased += 1
        fold.version(item.policy_version).rollouts_leased += 1
    lags = [item.lag for item in body.items]
    fold.batch(
        BatchPatch(
            first_event=event.stream_id,
            trainer_id=body.trainer_id,
            policy_version=body.policy_version,
            leased_at_ms=event.t_ms,
            expires_at_ms=body.expires_at_ms,
            size=len(body.items),
            tokens=sum(item.tokens for item in body.items),
            lag_mean=sum(lags) / len(lags) if lags else None,
            lag_max=max(lags) if lags else None,
        ),
        body.batch_id,
    )


def _fold_acked(fold: Fold, event: Event, body: Acked) -> None:
    run = fold.run
    run.batches_acked += 1
    for item in body.items:
        # Acked items carry no lag, and the batch's leased event (which does) may be folded in
        # another transaction: derive it by the rule lease.lua applies to that event's items.
        lag = lag_of(body.policy_version, item.policy_version)
        for totals in (run, fold.version(item.policy_version)):
            totals.rollouts_acked += 1
            totals.tokens_consumed += item.tokens
            totals.lag_samples += 1
            totals.lag_sum += lag
            totals.lag_max = lag if totals.lag_max is None else max(totals.lag_max, lag)
        key = (item.policy_version, lag)
        fold.lags[key] = fold.lags.get(key, 0) + 1
        if item.kl is not None:
            # Per version the KL is token-weighted from the per-rollout values; per run the
            # exact per-token sums of the event are used instead (below).
            version = fold.version(item.policy_version)
            version.kl_tokens += item.tokens
            version.kl_sum += item.kl * item.tokens
            version.kl_max = _max(version.kl_max, item.kl)
            run.kl_max = _max(run.kl_max, item.kl)
    run.kl_tokens += body.sums.kl_tokens
    run.kl_sum += body.sums.kl_sum
    run.kl_max = _max(run.kl_max, body.stats.kl_max)
    run.ratio_tokens += body.sums.ratio_tokens
    run.ratio_sum += body.sums.ratio_sum
    run.ratio_clipped += body.sums.clipped
    fold.batch(
        BatchPatch(
            first_event=event.stream_id,
            outcome="acked",
            acked_at_ms=event.t_ms,
            samples=len(body.items),
            kl_mean=body.stats.kl_mean,
            kl_max=body.stats.kl_max,
            is_ratio_mean=body.stats.is_ratio_mean,
            clip_fraction=body.stats.clip_fraction,
            ess_fraction=body.stats.ess_fraction,
            step=body.step,
        ),
        body.batch_id,
    )


def _fold_returned(fold: Fold, event: Event, body: Returned) -> None:
    nacked = event.type == "nacked"
    if nacked:
        fold.run.batches_nacked += 1
    else:
        fold.run.batches_expired += 1
    for item in body.items:
        for totals in (fold.run, fold.version(item.policy_version)):
            if nacked:
                totals.rollouts_nacked += 1
            else:
                totals.rollouts_expired += 1
    patch = BatchPatch(first_event=event.stream_id, outcome=event.type)
    if nacked:
        patch.nacked_at_ms = event.t_ms
    else:
        patch.expired_at_ms = event.t_ms
    fold.batch(patch, body.batch_id)


def _fold_retired(fold: Fold, body: Retired) -> None:
    for item in body.items:
        wasted = item.uses == 0
        for totals in (fold.run, fold.version(item.policy_version)):
            totals.rollouts_retired += 1
            if wasted:
                totals.wasted_tokens += item.tokens
        reason = fold.reason(item.policy_version, RETIRED, body.reason)
        reason.rollouts += 1
        reason.tokens += item.tokens
        if wasted:
            reason.unused += 1
            reason.wasted_tokens += item.tokens
