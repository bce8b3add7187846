"""Response models of the accounting API (SPEC.md, "Accounting")."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BatchCounts",
    "BatchPage",
    "BatchRecord",
    "BiasStats",
    "ConsumerCounts",
    "DeadLetter",
    "DeadLetterPage",
    "GeneratorAccounting",
    "GeneratorsAccounting",
    "IsRatioStats",
    "KlStats",
    "LagStats",
    "LengthBias",
    "LengthHistograms",
    "LiveCounts",
    "LiveRewardCounts",
    "PoolCounts",
    "PromptCounts",
    "PromptPage",
    "PromptPassRecord",
    "RewardBias",
    "RewardCounts",
    "RunAccounting",
    "TrainingAccounting",
    "TrainingVersion",
    "VersionAccounting",
    "VersionsAccounting",
    "WaitStats",
]


class BatchCounts(BaseModel):
    leased: int = Field(description="Batches ever leased")
    acked: int
    nacked: int
    expired: int


class LagStats(BaseModel):
    """Lag of the samples (acknowledged uses): trainer version minus rollout version."""

    mean: float | None = Field(description="null when nothing was consumed")
    max: int | None
    histogram: dict[int, int] = Field(description="lag -> samples")
    token_mean: float | None = Field(
        description="Mean over the trained tokens consumed of each token's own lag (trainer "
        "version minus the version that sampled it); null when nothing was consumed"
    )


class KlStats(BaseModel):
    mean: float | None = Field(description="Token-weighted mean KL; null when none measured")
    max: float | None = Field(description="Largest per-rollout KL measured")


class IsRatioStats(BaseModel):
    mean: float | None = Field(description="Mean importance ratio over measured tokens")
    clip_fraction: float | None = Field(description="Share of tokens outside [1-eps, 1+eps]")


class PoolCounts(BaseModel):
    """Queued prompt passes per difficulty pool (SPEC "Difficulty"), each prompt judged from its
    newest group mean and the run's current thresholds; their sum is ``queued``."""

    easy: int = Field(description="Queued passes of prompts whose newest mean is above easy_above")
    normal: int = Field(
        description="Queued passes of prompts between the thresholds, or with no mean yet"
    )
    hard: int = Field(description="Queued passes of prompts whose newest mean is below hard_below")


class PromptCounts(BaseModel):
    """Prompt passes of a run that takes its work from the broker (a prompt queued for
    ``epochs`` passes counts ``epochs`` times); once drained, ``registered == queued +
    in_flight + done + failed`` (``done`` counts the ``skipped`` and ``cancelled`` passes too)."""

    registered: int = Field(description="Passes of the registered prompts")
    queued: int = Field(description="Passes waiting to be handed out (again)")
    in_flight: int = Field(description="Passes in a generator's work lease")
    done: int = Field(
        description="Passes whose group reached a gradient or retired zero_variance, and the "
        "skipped and cancelled ones (so that registered == queued + in_flight + done + failed)"
    )
    failed: int = Field(description="Passes that ran out of attempts")
    retried: int = Field(description="Attempts after the first, summed over the passes")
    skipped: int = Field(
        description="Of done, the passes skipped without generation: queued in a difficulty "
        "pool of weight 0",
    )
    cancelled: int = Field(
        default=0,
        description="Of done, the passes cancelled without generation: queued, or on their way "
        "back to the queue, when their run closed",
    )
    pools: PoolCounts | None = Field(
        description="Queued passes per difficulty pool (easy + normal + hard == queued); null "
        "when the run has no difficulty",
    )


class PartialCounts(BaseModel):
    """Partial rollouts of prompts given back (SPEC "Partial rollouts"). A partial counts as
    returned each time it comes back with its prompt: given back, or brought back by an attempt
    that ended before its generator posted it."""

    returned: int = Field(description="Partials that came back with their prompts")
    resumed: int = Field(description="Partials handed out again with a work lease")
    dropped: int = Field(
        description="Partials dropped: too stale when handed out, left out of their completed "
        "group, or of a pass that failed"
    )
    tokens_resumed: int = Field(description="Response tokens of the partials resumed")
    tokens_dropped: int = Field(description="Response tokens of the partials dropped")


class WaitStats(BaseModel):
    generator_s: float = Field(description="Time generators' requests waited for prompts or budget")
    trainer_s: float = Field(description="Time trainers' lease requests waited for rollouts")
    reward_s: float = Field(
        description="Time from ingest to score, summed over the rollouts scored through "
        "POST .../rewards"
    )


class RewardCounts(BaseModel):
    """Rollouts posted without a reward (SPEC "Rewards"). The awaiting and reward-leased ones
    are buffered too: they count in ``buffered``."""

    awaiting: int = Field(description="Unscored rollouts buffered and in no live reward lease")
    leased: int = Field(description="Unscored rollouts in live reward leases")
    scored: int = Field(description="Rollouts that got their reward through POST .../rewards")
    timed_out: int = Field(
        description="Expiries of reward leases, one per unscored rollout in the lease (a "
        "rollout counts once per expiry, up to max_reward_attempts)"
    )


class LengthHistograms(BaseModel):
    """The two length distributions, log-spaced (app/accounting/bias.py: a bucket for 0, then
    four a doubling): each bucket, named by its first trained length, -> rollouts in it; empty
    buckets are left out."""

    generated: dict[int, int] = Field(description="first length of a bucket -> rollouts received")
    trained: dict[int, int] = Field(description="first length of a bucket -> samples consumed")


class LengthBias(BaseModel):
    """Trained-token lengths (tokens not posted with loss_mask 0) of the rollouts received
    against those of the samples consumed (a rollout used twice counts twice)."""

    generated_mean: float | None = Field(
        description="Mean trained length of the rollouts received; null when none was"
    )
    trained_mean: float | None = Field(
        description="Mean trained length of the samples consumed; null when none was"
    )
    ks: float | None = Field(
        description="Kolmogorov-Smirnov distance between the two length distributions, read from "
        "their histograms (that of the bucketed lengths): 0 the same, 1 disjoint; null when "
        "either side is empty"
    )
    histogram: LengthHistograms


class RewardBias(BaseModel):
    generated_mean: float | None = Field(
        description="Mean reward of the rollouts received, posted with it or scored later; null "
        "when none has one"
    )
    trained_mean: float | None = Field(
        description="Mean reward of the samples consumed (each use counts), over those whose "
        "reward was known when handed out; null when none"
    )


class BiasStats(BaseModel):
    """Whether a run trains on a biased share of what it generates (SPEC "Accounting")."""

    length: LengthBias
    reward: RewardBias


class LiveRewardCounts(BaseModel):
    awaiting: int = Field(description="Unscored rollouts in no live reward lease")
    leased: int = Field(description="Unscored rollouts in live reward leases")


class LiveCounts(BaseModel):
    """The broker's own counts of a run's rollouts, read from its live state in Redis."""

    buffered: int = Field(description="Rollouts stored and not leased (incomplete groups too)")
    leased: int = Field(description="Rollouts in live leases")
    rewards: LiveRewardCounts = Field(
        description="Of the buffered rollouts, those awaiting their reward: in no live reward "
        "lease, and in one"
    )


class ConsumerCounts(BaseModel):
    """One consumer's items (SPEC "Consumers"), summed over every consumer of that name."""

    delivered: int = Field(description="Items delivered to it")
    acked: int = Field(description="Items it acknowledged")
    pending: int = Field(
        description="delivered - acked - dropped: the items pending, and those in its live leases"
    )
    dropped: int = Field(
        description="Items dropped: beyond retention_rollouts, beyond max_lag when leased, or "
        "held when it was deleted"
    )


class RunAccounting(BaseModel):
    """A run's accounting; once drained, ``rollouts_received == buffered + leased + Σ retired``
    and ``samples_consumed == Σ sizes of the acknowledged batches``; and with no dead letters,
    ``buffered == live.buffered``, ``leased == live.leased``, and ``rewards.awaiting`` and
    ``rewards.leased`` equal ``live.rewards``'s."""

    rollouts_received: int
    groups_received: int
    duplicates: int
    rejected: dict[str, int] = Field(description="reason -> rollouts")
    tokens_generated: int
    tokens_masked: int = Field(
        description="Of tokens_generated, those posted with loss_mask 0 (never trained)"
    )
    tokens_masked_stale: int = Field(
        description="Trained tokens of the samples handed out with loss_mask 0 for their own "
        "lag (stale_tokens 'mask')"
    )
    buffered: int
    leased: int = Field(description="Rollouts in live leases")
    samples_consumed: int = Field(description="Σ uses: rollouts in acknowledged batches")
    samples_rewound: int = Field(
        description="Of samples_consumed, the uses a rewind of the policy version gave back to "
        "their rollouts (the batches it undid); they stay in samples_consumed"
    )
    tokens_consumed: int = Field(description="Trained tokens of the samples")
    reuse_factor: float = Field(description="samples_consumed / rollouts_received (0 if none)")
    retired: dict[str, int] = Field(description="reason -> rollouts")
    wasted_tokens: int = Field(description="Tokens of rollouts that retired with no use")
    batches: BatchCounts
    lag: LagStats
    kl: KlStats
    is_ratio: IsRatioStats
    kl_coef: float | None = Field(
        description="β of the adaptive KL penalty after the newest ack; null when the "
        "penalty is off, or before any ack"
    )
    prompts: PromptCounts
    partials: PartialCounts
    rewards: RewardCounts
    wait: WaitStats
    bias: BiasStats
    as_of: datetime | None = Field(description="Time of the newest drained event")
    pending_events: int = Field(description="Stream entries not yet drained into Postgres")
    dead_letters: int = Field(
        description="Events the ledger could not apply (0 for valid traffic): see "
        "/accounting/dead-letters"
    )
    live: LiveCounts | None = Field(
        description="The broker's live counts, read at the same moment as pending_events; "
        "null when the run has no live state (deleted)"
    )
    consumers: dict[str, ConsumerCounts] = Field(
        default_factory=dict, description="consumer name -> its items; empty when none"
    )


class VersionAccounting(BaseModel):
    """The accounting of the rollouts one policy version generated. Duplicates, batches and
    importance ratios are per run only: their events do not attribute them to a version."""

    policy_version: int
    rollouts_received: int
    groups_received: int
    rejected: dict[str, int]
    tokens_generated: int
    tokens_masked: int
    tokens_masked_stale: int
    buffered: int
    leased: int
    samples_consumed: int
    samples_rewound: int = Field(
        description="Of samples_consumed, uses of this version's rollouts a rewind gave back"
    )
    tokens_consumed: int
    reuse_factor: float
    retired: dict[str, int]
    wasted_tokens: int
    lag: LagStats
    kl: KlStats
    rewards: RewardCounts
    kl_coef: float | None = Field(
        description="β of the adaptive KL penalty after the newest ack of a batch leased at "
        "this version; null when none, or when that ack had none (the penalty off)"
    )


class GeneratorAccounting(BaseModel):
    """One generator's rollouts, their uses and the mismatch measured on them."""

    generator_id: str
    rollouts: int = Field(description="Rollouts accepted from it")
    tokens: int = Field(description="Their tokens (trained and masked)")
    samples_consumed: int = Field(
        description="Uses of its rollouts in acknowledged batches, less those a rewind undid"
    )
    kl: KlStats = Field(description="Over its measured tokens; null when none was measured")
    is_ratio: IsRatioStats = Field(description="Over its measured tokens; null when none")
    masked_fraction: float | None = Field(
        description="Share of its measured tokens the run's correction weighed 0; null when none"
    )
    last_seen: datetime | None = Field(description="Time of its newest accepted rollout")
    quarantined: bool


class GeneratorsAccounting(BaseModel):
    generators: list[GeneratorAccounting] = Field(description="Ascending generator_id")
    as_of: datetime | None = Field(description="Time of the newest drained event")
    pending_events: int = Field(description="Stream entries not yet drained into Postgres")


class VersionsAccounting(BaseModel):
    versions: list[VersionAccounting]
    as_of: datetime | None
    pending_events: int


class TrainingVersion(BaseModel):
    """The acknowledged batches leased at one policy version of the trainer (the batches' V),
    with the KL and importance ratios of their acks, token-weighted over the measured tokens."""

    policy_version: int = Field(description="The trainer's version V of the leases")
    batches: int = Field(description="Acknowledged batches")
    samples: int = Field(description="Rollouts in them (uses)")
    tokens: int = Field(description="Their tokens")
    kl_mean: float | None = Field(description="Token-weighted mean KL; null when none measured")
    kl_max: float | None = Field(description="Largest per-rollout KL measured")
    is_ratio_mean: float | None = Field(
        description="Mean importance ratio over measured tokens; null when none measured"
    )
    clip_fraction: float | None = Field(
        description="Share of measured tokens outside [1-eps, 1+eps]; null when none measured"
    )
    kl_coef: float | None = Field(
        description="β after the newest ack at this version; null when that ack had none"
    )


class TrainingAccounting(BaseModel):
    """Per policy version of the trainer; batches, samples and tokens sum to the run's acked
    batches, samples_consumed and tokens_consumed."""

    versions: list[TrainingVersion] = Field(description="Ascending policy_version")
    pending_events: int = Field(description="Stream entries not yet drained into Postgres")


class BatchRecord(BaseModel):
    batch_id: str
    outcome: str = Field(description="leased, acked, nacked or expired")
    trainer_id: str | None
    policy_version: int | None = Field(description="The trainer's version V of the lease")
    leased_at: datetime | None
    expires_at: datetime | None
    acked_at: datetime | None
    nacked_at: datetime | None
    expired_at: datetime | None
    rewound_at: datetime | None = Field(
        description="When a rewind of the policy version undid the batch (its rollouts got "
        "their uses back; it stays acked); null when none did"
    )
    size: int | None = Field(description="Rollouts leased")
    tokens: int | None
    lag_mean: float | None
    lag_max: int | None
    kl_mean: float | None
    kl_max: float | None
    is_ratio_mean: float | None
    clip_fraction: float | None
    ess_fraction: float | None
    step: int | None


class BatchPage(BaseModel):
    batches: list[BatchRecord]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page")


class DeadLetter(BaseModel):
    dead_id: str = Field(description="Id in the dead-letter stream (the listing's cursor)")
    stream_id: str = Field(description="Id the entry had in the run's event stream")
    event: str | None = Field(description="The entry's 'e' field")
    payload: str | None = Field(description="The entry's 'd' field, base64")
    error: str
    deliveries: int
    consumer: str
    dead_at: datetime


class DeadLetterPage(BaseModel):
    count: int = Field(description="Dead letters of the run in all")
    dead_letters: list[DeadLetter]
    next_cursor: str | None


class PromptPassRecord(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    prompt_id: str
    pass_: int = Field(alias="pass", description="1 .. the prompt's epochs")
    attempt: int = Field(description="1 for the first hand-out; one more each time it came back")
    state: str = Field(description="queued, in_flight, done, failed, skipped or cancelled")
    tries: int = Field(
        description="Attempts whose group retired unused, whose lease expired or that a stale "
        "rollout ended"
    )
    mean: float | None = Field(
        description="The mean reward of the prompt's newest complete group (what its difficulty "
        "pool is judged by); null before one",
    )


class PromptPage(BaseModel):
    prompts: list[PromptPassRecord]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page")
