"""Folding of one run's newly drained events into additive deltas for the accounting tables.

Every delta is commutative (sums, maxima, minima, "newest snapshot wins", "greatest pass state
wins"), so the order in which workers apply batches of events does not change the result: a
batch claimed from a dead consumer may land after a later one.

An event that decodes but cannot be applied (a prompt pass state or a waiting role this module
does not know) raises :class:`~app.events.EventError`: the drain treats it like a
payload it cannot decode, and dead-letters the entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import assert_never

from app.events import (
    Accepted,
    Acked,
    Duplicate,
    Event,
    EventError,
    Leased,
    PassesChanged,
    Registered,
    Rejected,
    Retired,
    Returned,
    RunChanged,
    StreamId,
    Waited,
    WorkLeased,
    lag_of,
)

__all__ = [
    "MAX_PASSES",
    "PASS_RANK",
    "BatchPatch",
    "Fold",
    "PassCounts",
    "PassState",
    "ReasonDelta",
    "RunSnapshot",
    "RunTotalsDelta",
    "TotalsDelta",
    "TrainingDelta",
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
    prompts_registered: int = 0  # Σ passes of the registered prompts
    trainer_wait_ms: int = 0
    generator_wait_ms: int = 0


@dataclass
class TrainingDelta:
    """What the acknowledged batches of one trainer version (the ``policy_version`` V of their
    lease) add: batches, samples and tokens, and the exact KL and ratio sums of their acks."""

    batches: int = 0
    samples: int = 0
    tokens: int = 0
    kl_tokens: int = 0
    kl_sum: float = 0.0
    kl_max: float | None = None
    ratio_tokens: int = 0
    ratio_sum: float = 0.0
    ratio_clipped: int = 0


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


# A pass's states within one attempt: queued < in_flight < done = failed (both final).
PASS_RANK = {"queued": 0, "in_flight": 1, "done": 2, "failed": 2}

# More passes than this in one `registered` item is not a real run's epochs but a broken event;
# folding it would build that many rows in memory.
MAX_PASSES = 100_000

_WAIT_COLUMNS = {"trainer": "trainer_wait_ms", "generator": "generator_wait_ms"}


@dataclass(frozen=True, slots=True)
class PassState:
    """What one event says about one prompt pass.

    States are ordered by :attr:`order`: the attempt, then the state's rank, then the state's
    name, which only separates ``done`` from ``failed`` at one attempt (never both for a real
    pass, but the order must be total for the result not to depend on which came first).
    :meth:`merge` keeps the greatest state, the largest ``tries`` (it only ever grows, and a
    ``work_leased`` item does not carry it) and, of the events that said the winning state,
    the earliest time. Each of the three is commutative and associative, so folding a pass's
    events in any order, in any grouping, gives one row.
    """

    attempt: int
    state: str
    tries: int
    t_ms: int

    @property
    def order(self) -> tuple[int, int, str]:
        return (self.attempt, PASS_RANK[self.state], self.state)

    def merge(self, other: PassState) -> PassState:
        mine, theirs = self.order, other.order
        winner = self if mine >= theirs else other
        t_ms = min(self.t_ms, other.t_ms) if mine == theirs else winner.t_ms
        return PassState(winner.attempt, winner.state, max(self.tries, other.tries), t_ms)


@dataclass
class PassCounts:
    """Change of the run's prompt-pass counters: rows per state, and Σ (attempt - 1)."""

    prompts_queued: int = 0
    prompts_in_flight: int = 0
    prompts_done: int = 0
    prompts_failed: int = 0
    prompts_retried: int = 0

    def move(self, old: PassState | None, new: PassState) -> None:
        """A ledger row went from ``old`` (``None``: it did not exist) to ``new``."""
        retried = new.attempt - 1
        if old is not None:
            self._add(old.state, -1)
            retried -= old.attempt - 1
        self._add(new.state, 1)
        self.prompts_retried += retried

    def _add(self, state: str, n: int) -> None:
        name = f"prompts_{state}"
        setattr(self, name, getattr(self, name) + n)


def _pass_state(state: str, attempt: int, tries: int, t_ms: int) -> PassState:
    if state not in PASS_RANK:
        raise EventError(f"unknown prompt pass state {state!r}")
    return PassState(attempt, state, tries, t_ms)


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
    trainings: dict[int, TrainingDelta] = field(default_factory=dict)  # by the batches' V
    reasons: dict[tuple[int, str, str], ReasonDelta] = field(default_factory=dict)
    lags: dict[tuple[int, int], int] = field(default_factory=dict)
    batches: dict[str, BatchPatch] = field(default_factory=dict)
    snapshot: RunSnapshot | None = None
    passes: dict[tuple[str, int], PassState] = field(default_factory=dict)  # (prompt_id, pass)

    def version(self, policy_version: int) -> TotalsDelta:
        delta = self.versions.get(policy_version)
        if delta is None:
            delta = self.versions[policy_version] = TotalsDelta()
        return delta

    def training(self, policy_version: int) -> TrainingDelta:
        delta = self.trainings.get(policy_version)
        if delta is None:
            delta = self.trainings[policy_version] = TrainingDelta()
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

    def prompt_pass(self, prompt_id: str, pass_: int, state: PassState) -> None:
        key = (prompt_id, pass_)
        known = self.passes.get(key)
        self.passes[key] = state if known is None else known.merge(state)


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
        elif isinstance(body, Retired):
            _fold_retired(fold, body)
        elif isinstance(body, Registered):
            _fold_registered(fold, event, body)
        elif isinstance(body, WorkLeased):
            _fold_work_leased(fold, event, body)
        elif isinstance(body, PassesChanged):
            _fold_passes(fold, event, body)
        elif isinstance(body, Waited):
            _fold_waited(fold, body)
        else:
            assert_never(body)
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
    fold.run.trainer_wait_ms += body.wait_ms
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
    # The same exact sums per trainer version (the V of the lease), which the per-version
    # totals above cannot give: those are keyed by the version that generated the rollouts.
    training = fold.training(body.policy_version)
    training.batches += 1
    training.samples += len(body.items)
    training.tokens += sum(item.tokens for item in body.items)
    training.kl_tokens += body.sums.kl_tokens
    training.kl_sum += body.sums.kl_sum
    training.kl_max = _max(training.kl_max, body.stats.kl_max)
    training.ratio_tokens += body.sums.ratio_tokens
    training.ratio_sum += body.sums.ratio_sum
    training.ratio_clipped += body.sums.clipped
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


def _fold_registered(fold: Fold, event: Event, body: Registered) -> None:
    for item in body.items:
        if item.passes > MAX_PASSES:
            raise EventError(f"registered: {item.passes} passes, more than {MAX_PASSES}")
        fold.run.prompts_registered += item.passes
        for pass_ in range(1, item.passes + 1):
            fold.prompt_pass(item.prompt_id, pass_, PassState(1, "queued", 0, event.t_ms))


def _fold_work_leased(fold: Fold, event: Event, body: WorkLeased) -> None:
    fold.run.generator_wait_ms += body.wait_ms
    for item in body.items:
        # The item does not say `tries`; 0 never wins over a known count (PassState.merge).
        fold.prompt_pass(
            item.prompt_id, item.pass_, PassState(item.attempt, "in_flight", 0, event.t_ms)
        )


def _fold_passes(fold: Fold, event: Event, body: PassesChanged) -> None:
    for item in body.items:
        state = _pass_state(item.state, item.attempt, item.tries, event.t_ms)
        fold.prompt_pass(item.prompt_id, item.pass_, state)


def _fold_waited(fold: Fold, body: Waited) -> None:
    column = _WAIT_COLUMNS.get(body.role)
    if column is None:
        raise EventError(f"waited: unknown role {body.role!r}")
    setattr(fold.run, column, getattr(fold.run, column) + body.wait_ms)
