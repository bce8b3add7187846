"""What a fold of one run's events produces and the repository adds to the tables: counters per
run, per rollout version and per trainer version, reasons, batch-ledger patches, the run's
newest snapshot and the prompt passes' states (:class:`Fold`). Every delta is commutative
(see app/accounting/fold.py)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from app.accounting.bias import bucket_of_one
from app.accounting.passes import PassState
from app.events import EventError, StreamId

__all__ = [
    "BATCH_VALUE_FIELDS",
    "MAX_COLUMNS",
    "MIN_COLUMNS",
    "NEWEST_GROUPS",
    "REWARD_LATENCY_BOUNDS_MS",
    "BatchPatch",
    "Fold",
    "GeneratorDelta",
    "PromptMeanDelta",
    "ReasonDelta",
    "RunSnapshot",
    "RunTotalsDelta",
    "TotalsDelta",
    "TrainingDelta",
    "tell",
]


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
    tokens_consumed: int = 0  # trained tokens of the samples
    wasted_tokens: int = 0
    lag_samples: int = 0
    lag_sum: int = 0
    tokens_masked: int = 0  # of tokens_generated, those posted with loss_mask 0
    tokens_masked_stale: int = 0  # trained tokens handed out masked for their own lag
    lag_token_sum: int = 0  # Σ over tokens_consumed of each token's own lag
    lag_max: int | None = None
    kl_tokens: int = 0
    kl_sum: float = 0.0
    kl_max: float | None = None
    # Uses a rewind gave back (the `rewound` events' items); still in rollouts_acked.
    samples_rewound: int = 0
    # Rollouts posted without a reward (docs/events.md): net moves in and out of awaiting and
    # of reward leases (a batch may hold a move out whose move in is in another), those scored
    # through the API, and the expiries of reward leases, one per unscored rollout in them.
    rewards_awaiting: int = 0
    rewards_leased: int = 0
    rewards_scored: int = 0
    rewards_timed_out: int = 0


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
    reward_wait_ms: int = 0  # Σ ingest → score of the scored rollouts
    # Partial rollouts (the `partials` events): how many came back, went out again or were
    # dropped, and the response tokens of those resumed and dropped.
    partials_returned: int = 0
    partials_resumed: int = 0
    partials_dropped: int = 0
    partial_tokens_resumed: int = 0
    partial_tokens_dropped: int = 0
    # β after the newest ack (its stream id): None when that ack had none (the penalty off).
    kl_coef: float | None = None
    kl_coef_ms: int | None = None
    kl_coef_seq: int | None = None
    # The reward side of the bias figures: rewards of the rollouts received (posted with one,
    # or scored later) and of the samples consumed (acked items that tell theirs), counted and
    # summed.
    reward_generated_n: int = 0
    reward_generated_sum: float = 0.0
    reward_trained_n: int = 0
    reward_trained_sum: float = 0.0


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
    # β after the newest ack at this version (its stream id), as the run's.
    kl_coef: float | None = None
    kl_coef_ms: int | None = None
    kl_coef_seq: int | None = None


@dataclass
class GeneratorDelta:
    """What one generator's rollouts add: received (``accepted`` items naming it), their uses
    (``acked`` ``gens``, less the uses a rewind undid) and the sums of their measured tokens;
    and whether it is quarantined, as told by the newest ``generator`` event."""

    rollouts: int = 0
    tokens: int = 0
    samples_consumed: int = 0
    kl_tokens: int = 0
    kl_sum: float = 0.0
    kl_max: float | None = None
    ratio_tokens: int = 0
    ratio_sum: float = 0.0
    clipped: int = 0
    zero_weight: int = 0  # of ratio_tokens, those the run's correction weighs 0
    last_seen_ms: int | None = None  # time of its newest accepted rollout
    quarantined: bool = False
    quarantined_ms: int | None = None  # stream id of the event that told it; None: none did
    quarantined_seq: int | None = None


@dataclass
class ConsumerDelta:
    """What ``consumers`` events add to one consumer's counts (by name: a consumer deleted and
    created again under the same name keeps adding to the same row)."""

    delivered: int = 0
    acked: int = 0
    dropped: int = 0


REWARD_LATENCY_BOUNDS_MS = (100, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000,
                            300_000, 600_000, 1_800_000)  # fmt: skip
"""Upper bounds of the reward-latency histogram's buckets (ingest → score), in ms; the ledger
keeps the scores per bucket (not cumulative), and the last bucket (+Inf) is every score."""

# Columns merged with GREATEST / LEAST instead of addition.
MAX_COLUMNS = frozenset({"lag_max", "kl_max", "last_event_ms", "last_seen_ms"})
MIN_COLUMNS = frozenset({"first_event_ms"})
# Values told by an event, each with the stream id (ms, seq) of the event that told it: the
# newest wins, whatever order the events are applied in; a delta whose id is None told nothing.
NEWEST_GROUPS = {
    "kl_coef": ("kl_coef_ms", "kl_coef_seq"),
    "quarantined": ("quarantined_ms", "quarantined_seq"),
    "mean": ("event_ms", "event_seq"),
}


def tell(delta: object, name: str, stream_id: StreamId, value: object) -> None:
    """Set ``name`` of ``delta`` to ``value`` unless a newer event already told it."""
    ms, seq = NEWEST_GROUPS[name]
    known_ms, known_seq = getattr(delta, ms), getattr(delta, seq)
    if known_ms is not None and (known_ms, known_seq) > (stream_id.ms, stream_id.seq):
        return
    setattr(delta, name, value)
    setattr(delta, ms, stream_id.ms)
    setattr(delta, seq, stream_id.seq)


@dataclass
class PromptMeanDelta:
    """What ``prompt_scored`` events say of one prompt: the mean reward of its newest group
    (told by the newest event, whatever the order applied) and how many groups were told."""

    mean: float | None = None
    groups: int = 0
    event_ms: int | None = None
    event_seq: int | None = None


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
    rewound_at_ms: int | None = None  # a rewind undid the batch (it stays acked)

    def merge(self, other: BatchPatch) -> None:
        """Fold a later event's patch into this one (terminal outcomes win over ``leased``)."""
        self.first_event = min(self.first_event, other.first_event)
        if other.outcome != "leased":
            self.outcome = other.outcome
        rewound = [t for t in (self.rewound_at_ms, other.rewound_at_ms) if t is not None]
        for name in BATCH_VALUE_FIELDS:
            value = getattr(other, name)
            if value is not None:
                setattr(self, name, value)
        # Told by each rewind that undid the batch: the first time, whatever the order.
        self.rewound_at_ms = min(rewound, default=None)


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
    "rewound_at_ms",
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


K = TypeVar("K", bound=Hashable)
D = TypeVar("D")


def _entry(table: dict[K, D], key: K, make: Callable[[], D]) -> D:
    """``table[key]``, made by ``make`` the first time it is asked for."""
    found = table.get(key)
    if found is None:
        found = table[key] = make()
    return found


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
    # Scores per bucket of the reward latency: the bucket's bound (ms) -> scores in it
    reward_latency: dict[int, int] = field(default_factory=dict)
    generators: dict[str, GeneratorDelta] = field(default_factory=dict)  # by generator_id
    # The length histograms of the bias figures: (side, bucket of app.accounting.bias) ->
    # rollouts received ("generated") or samples consumed ("trained") of that trained length
    lengths: dict[tuple[str, int], int] = field(default_factory=dict)
    means: dict[str, PromptMeanDelta] = field(default_factory=dict)  # by prompt_id
    consumers: dict[str, ConsumerDelta] = field(default_factory=dict)  # by consumer name

    def version(self, policy_version: int) -> TotalsDelta:
        return _entry(self.versions, policy_version, TotalsDelta)

    def training(self, policy_version: int) -> TrainingDelta:
        return _entry(self.trainings, policy_version, TrainingDelta)

    def generator(self, generator_id: str) -> GeneratorDelta:
        return _entry(self.generators, generator_id, GeneratorDelta)

    def consumer(self, name: str) -> ConsumerDelta:
        return _entry(self.consumers, name, ConsumerDelta)

    def prompt_mean(self, prompt_id: str) -> PromptMeanDelta:
        return _entry(self.means, prompt_id, PromptMeanDelta)

    def reason(self, policy_version: int, kind: str, reason: str) -> ReasonDelta:
        return _entry(self.reasons, (policy_version, kind, reason), ReasonDelta)

    def batch(self, patch: BatchPatch, batch_id: str) -> None:
        known = self.batches.get(batch_id)
        if known is None:
            self.batches[batch_id] = patch
        else:
            known.merge(patch)

    def observe_reward_latency(self, wait_ms: int) -> None:
        """One score in the smallest bucket that holds it; one beyond the last bound is only
        in the histogram's count (``rewards_scored``) and sum (``reward_wait_ms``)."""
        bound = next((b for b in REWARD_LATENCY_BOUNDS_MS if wait_ms <= b), None)
        if bound is not None:
            self.reward_latency[bound] = self.reward_latency.get(bound, 0) + 1

    def observe_length(self, side: str, trained: int) -> None:
        """One rollout received or sample consumed of ``trained`` trained tokens."""
        try:
            key = (side, bucket_of_one(trained))
        except ValueError as exc:
            raise EventError(f"{side} length {trained}: {exc}") from None
        self.lengths[key] = self.lengths.get(key, 0) + 1

    def prompt_pass(self, prompt_id: str, pass_: int, state: PassState) -> None:
        key = (prompt_id, pass_)
        known = self.passes.get(key)
        self.passes[key] = state if known is None else known.merge(state)
