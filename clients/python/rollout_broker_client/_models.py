"""What the client sends and receives: rollouts with numpy arrays, runs, batches, accounting,
access tokens and the audit log."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypedDict

import numpy as np
import numpy.typing as npt

from rollout_broker_client._arrays import PackedArrays, PaddingSide, TrainArrays, pack, pad

__all__ = [
    "AccessToken",
    "Accounting",
    "AckArgs",
    "AckResult",
    "AuditEntry",
    "AuditPage",
    "Batch",
    "BatchCounts",
    "BatchStats",
    "ConsumerBatch",
    "ConsumerInfo",
    "ConsumerKind",
    "ConsumerRollout",
    "ConsumerSource",
    "GeneratorAccounting",
    "IngestResult",
    "IsRatioStats",
    "KlStats",
    "LagStats",
    "LeasedRollout",
    "LiveCounts",
    "MeasureStats",
    "Measurement",
    "NewToken",
    "Pair",
    "PairRule",
    "PartialCounts",
    "PolicyResult",
    "PolicyVersion",
    "PoolName",
    "Prompt",
    "PromptCounts",
    "PromptState",
    "PromptStateName",
    "RegisterResult",
    "Rejection",
    "RewardCounts",
    "RewardLease",
    "RewardRollout",
    "Rollout",
    "Run",
    "RunConfig",
    "Scope",
    "ScoreResult",
    "TrainingVersion",
    "VersionAccounting",
    "WaitStats",
    "WorkLease",
    "WorkPrompt",
]

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]
UInt8Array = npt.NDArray[np.uint8]
FinishReason = Literal["stop", "length", "abort"]


class Correction(TypedDict, total=False):
    """``measure``'s importance-weight rule (SPEC "Correction before the update")."""

    level: Literal["token", "sequence", "geometric"]
    mode: Literal["truncate", "mask", "none"]
    low: float
    high: float


class PoolWeights(TypedDict, total=False):
    """How often work leases draw from each difficulty pool, per prompt queued in it."""

    easy: float
    normal: float
    hard: float


class Difficulty(TypedDict, total=False):
    """Prompt pools by the mean reward of each prompt's last completed group."""

    easy_above: float
    hard_below: float
    weights: PoolWeights


class RunConfig(TypedDict, total=False):
    """A run's rules (SPEC's RunConfig); every key is optional and has the broker's default."""

    max_staleness: int
    max_reuse: int
    kl_max: float
    kl_flush: float
    kl_flush_window: int
    kl_coef: float | None
    kl_target: float
    kl_horizon: int
    kl_estimator: Literal["k1", "k2", "k3"]
    clip_epsilon: float
    group_size: int
    group_timeout_s: float
    drop_zero_variance_groups: bool
    order: Literal["auto", "freshest", "fifo", "random"]
    stale_tokens: Literal["keep", "mask"]
    capacity_rollouts: int
    lease_timeout_s: float
    step_groups: int | None
    work_timeout_s: float
    max_attempts: int
    reward_timeout_s: float
    max_reward_attempts: int
    correction: Correction
    generator_kl_max: float | None
    generator_window_tokens: int
    difficulty: Difficulty | None


@dataclass(slots=True)
class Rollout:
    """One sampled response, as a generator posts it. Arrays may be numpy arrays or lists;
    ``logprobs`` are the behaviour policy's, one per response token. ``loss_mask`` (0/1 per
    response token, default all 1) marks with 0 the tokens not to train on (tool output,
    environment and user turns); ``versions`` gives the version that sampled each token as
    ``[(offset, version), ...]`` (default: every token at ``policy_version``, which must be the
    oldest version over trained tokens). ``reward`` None posts it unscored: it awaits its
    reward from a reward worker (:meth:`BrokerClient.reward_work`) before any trainer gets it."""

    rollout_id: str
    policy_version: int
    response_ids: npt.ArrayLike
    reward: float | None = None
    logprobs: npt.ArrayLike | None = None
    group_id: str | None = None
    prompt_ids: npt.ArrayLike | None = None
    finish_reason: FinishReason | None = None
    metadata: dict[str, Any] | None = None
    loss_mask: npt.ArrayLike | None = None
    versions: Sequence[Sequence[int]] | None = None
    generator_id: str | None = None


@dataclass(slots=True)
class Prompt:
    """One unit of generation work, as an operator registers it. ``prompt_id`` is the
    idempotency key; ``prompt_ids`` are its tokens and ``data`` any JSON object the generators
    need (the reference answer, a dataset index...); both come back with the work."""

    prompt_id: str
    prompt_ids: npt.ArrayLike | None = None
    data: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RegisterResult:
    accepted: int
    duplicates: int


@dataclass(frozen=True, slots=True, eq=False)
class Partial:
    """What a generator sampled of one response before its prompt was given back, handed out
    again with the prompt: continue it under your own weights and post the whole response
    under the same ``rollout_id`` (:meth:`continued`). A posted rollout that does not start
    with these tokens and logprobs is refused (``prefix_mismatch``)."""

    rollout_id: str
    group_id: str
    policy_version: int
    response_ids: Int32Array
    logprobs: Float32Array | None
    prompt_ids: Int32Array | None = None
    finish_reason: FinishReason | None = None
    metadata: dict[str, Any] | None = None
    loss_mask: UInt8Array | None = None  # None: every token is trained
    versions: tuple[tuple[int, int], ...] = ()  # (offset, version) segments; (): one version
    generator_id: str | None = None

    def continued(
        self,
        response_ids: npt.ArrayLike,
        reward: float | None,
        logprobs: npt.ArrayLike | None = None,
        *,
        version: int | None = None,
        loss_mask: npt.ArrayLike | None = None,
        finish_reason: FinishReason | None = "stop",
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        """The completed rollout: this partial's tokens, logprobs, mask and versions followed
        by the new ``response_ids`` (and ``logprobs``, needed when the partial has them),
        sampled at ``version`` (default: the partial's last) with ``loss_mask`` (default: all
        trained). Its ``policy_version`` stays the partial's, the oldest version over trained
        tokens. ``reward`` None posts it unscored, for a reward worker to score."""
        n = self.response_ids.size
        more = np.asarray(response_ids, dtype=np.int32)
        lp = None
        if self.logprobs is not None:
            if logprobs is None:
                raise ValueError(f"partial {self.rollout_id!r} has logprobs: give the new ones")
            lp = np.concatenate([self.logprobs, np.asarray(logprobs, dtype=np.float32)])
        mask = None
        if self.loss_mask is not None or loss_mask is not None:
            old = np.ones(n, np.uint8) if self.loss_mask is None else self.loss_mask
            new = np.ones(more.size, np.uint8) if loss_mask is None else np.asarray(loss_mask)
            mask = np.concatenate([old, new.astype(np.uint8)])
        segments = list(self.versions or ((0, self.policy_version),))
        if version is not None and version != segments[-1][1] and more.size:
            segments.append((n, version))
        return Rollout(
            rollout_id=self.rollout_id,
            policy_version=self.policy_version,
            response_ids=np.concatenate([self.response_ids, more]),
            reward=reward,
            logprobs=lp,
            group_id=self.group_id,
            prompt_ids=self.prompt_ids,
            finish_reason=finish_reason,
            metadata=self.metadata if metadata is None else metadata,
            loss_mask=mask,
            versions=[list(s) for s in segments] if len(segments) > 1 else None,
        )


@dataclass(frozen=True, slots=True, eq=False)
class WorkPrompt:
    """A prompt handed to a generator: sample ``group_size`` responses to it and post them with
    ``group_id``, which names this pass and attempt (``pass_`` is the wire's ``pass``, 1 to
    ``epochs``; ``attempt`` grows each time the prompt comes back). Compared by identity, as
    its token array cannot be compared by value."""

    prompt_id: str
    pass_: int
    attempt: int
    group_id: str
    prompt_ids: Int32Array | None
    data: dict[str, Any] | None
    partials: list[Partial] = field(default_factory=list)  # to continue, when it came back


@dataclass(frozen=True, slots=True)
class WorkLease:
    """Prompts leased to one generator at ``policy_version``; prompts whose group has not come
    in by ``expires_at`` go back to the queue."""

    lease_id: str
    policy_version: int
    expires_at: datetime
    prompts: list[WorkPrompt]


@dataclass(frozen=True, slots=True, eq=False)
class RewardRollout:
    """A rollout handed to a reward worker to score: its tokens (``prompt_ids`` those of its
    prompt, the registered prompt's when it was posted under a work lease), its loss mask, the
    prompt's ``data`` (the reference answer, say) and its ``metadata``. Compared by identity,
    as its arrays cannot be compared by value."""

    rollout_id: str
    group_id: str | None
    prompt_id: str | None
    prompt_ids: Int32Array | None
    response_ids: Int32Array
    loss_mask: UInt8Array | None = None  # None: every token is trained
    data: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class RewardLease:
    """Unscored rollouts leased to one reward worker; those not scored by ``expires_at`` are
    leased again (up to the run's ``max_reward_attempts``)."""

    lease_id: str
    expires_at: datetime
    rollouts: list[RewardRollout]


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """The answer to scores: how many were new, how many repeated a score already there, and
    the rollouts that had retired (stale, say) before their score came: nothing to do."""

    scored: int
    duplicates: int
    retired: list[str] = field(default_factory=list)


PromptStateName = Literal["queued", "in_flight", "done", "failed", "skipped", "cancelled"]
PoolName = Literal["easy", "normal", "hard"]


@dataclass(frozen=True, slots=True)
class PromptState:
    """Where one pass of a prompt is: ``tries`` counts its attempts that ended unused."""

    prompt_id: str
    pass_: int
    attempt: int
    state: PromptStateName
    tries: int
    mean: float | None = None  # the prompt's newest group mean reward; None before one


@dataclass(frozen=True, slots=True)
class Run:
    run_id: str
    config: RunConfig
    policy_version: int
    status: Literal["open", "closed"]
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Rejection:
    rollout_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class IngestResult:
    accepted: int
    duplicates: int
    rejected: list[Rejection]


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy_version: int
    evicted: int


@dataclass(frozen=True, slots=True)
class PolicyVersion:
    """A run's policy version as its followers see it: where its weights are (None when it was
    set without) and when it was set."""

    policy_version: int
    weights: str | None
    set_at: datetime


class _Masked:
    """What a rollout handed out for training has: its loss mask as an array."""

    __slots__ = ()
    loss_mask: UInt8Array | None
    response_ids: Int32Array

    @property
    def mask(self) -> UInt8Array:
        """The loss mask as an array, all 1 when every token is trained."""
        if self.loss_mask is not None:
            return self.loss_mask
        return np.ones(self.response_ids.size, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class LeasedRollout(_Masked):
    """A rollout handed to a trainer: its arrays as numpy, its ``uses`` so far and its ``lag``.
    ``loss_mask`` is the mask to train with (tokens posted with 0, and under ``stale_tokens:
    mask`` those too stale at hand-out); ``versions`` the run-length versions of its tokens."""

    rollout_id: str
    group_id: str | None
    policy_version: int
    prompt_ids: Int32Array | None
    response_ids: Int32Array
    logprobs: Float32Array | None
    reward: float
    finish_reason: FinishReason | None
    metadata: dict[str, Any] | None
    uses: int
    lag: int
    loss_mask: UInt8Array | None = None  # None: every token is trained
    versions: tuple[tuple[int, int], ...] = ()
    generator_id: str | None = None
    prompt_id: str | None = None  # the prompt it answers, when posted under a work lease

    @property
    def token_versions(self) -> npt.NDArray[np.int64]:
        """The version that sampled each response token."""
        segs = self.versions or ((0, self.policy_version),)
        starts = [o for o, _ in segs] + [self.response_ids.size]
        lengths = [end - start for start, end in itertools.pairwise(starts)]
        return np.repeat(np.array([v for _, v in segs], dtype=np.int64), lengths)


@dataclass(frozen=True, slots=True)
class BatchStats:
    kl_mean: float | None
    kl_max: float | None
    is_ratio_mean: float | None
    clip_fraction: float | None
    ess_fraction: float | None


@dataclass(frozen=True, slots=True)
class AckResult:
    consumed: int
    retired: int
    flushed: int
    stats: BatchStats
    kl_coef: float | None = None  # the adaptive KL penalty's β after the ack; None when off


@dataclass(frozen=True, slots=True)
class MeasureStats:
    """The ack's figures of a batch measured before the update, with the correction's."""

    kl_mean: float | None
    kl_max: float | None
    is_ratio_mean: float | None
    clip_fraction: float | None
    ess_fraction: float | None
    masked_fraction: float | None  # share of trained tokens whose weight is 0
    chi2: float | None  # the χ² divergence estimate over the sequence ratios


@dataclass(frozen=True, slots=True)
class Measurement:
    """A batch's correction (``measure``): per rollout, in batch order, a float32 weight per
    response token (0 on tokens not trained) and one sequence weight; the statistics; and the
    adaptive KL penalty's β to train with (None when off)."""

    weights: dict[str, npt.NDArray[np.float32]]
    sequence_weights: dict[str, float]
    stats: MeasureStats
    kl_coef: float | None = None


LogprobsArg = Mapping[str, npt.ArrayLike] | Sequence[npt.ArrayLike]


class AckArgs(TypedDict):
    logprobs: dict[str, npt.ArrayLike] | None
    kl: dict[str, float] | None
    step: int | None


@dataclass(slots=True)
class Batch:
    """A leased batch. Inside ``with client.lease(...) as batch`` call :meth:`ack_with` to give
    the current policy's logprobs (or ready-made KL values) that the ack on leaving will carry;
    after the block, :attr:`ack_result` holds the broker's answer."""

    batch_id: str
    policy_version: int
    lease_expires_at: datetime
    rollouts: list[LeasedRollout]
    kl_coef: float | None = None  # the adaptive KL penalty's β to train with; None when off
    ack_result: AckResult | None = None
    _ack: AckArgs = field(
        default_factory=lambda: AckArgs(logprobs=None, kl=None, step=None), repr=False
    )

    def __len__(self) -> int:
        return len(self.rollouts)

    def __iter__(self) -> Iterator[LeasedRollout]:
        return iter(self.rollouts)

    @property
    def rewards(self) -> npt.NDArray[np.float64]:
        return np.array([r.reward for r in self.rollouts], dtype=np.float64)

    def groups(self) -> dict[str, list[LeasedRollout]]:
        """Rollouts by ``group_id`` (a rollout without one is its own group), in batch order."""
        out: dict[str, list[LeasedRollout]] = {}
        for r in self.rollouts:
            out.setdefault(r.group_id or r.rollout_id, []).append(r)
        return out

    def padded(
        self,
        pad_id: int = 0,
        *,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: PaddingSide = "right",
        scale_by_std: bool = True,
        eps: float = 1e-6,
    ) -> TrainArrays[npt.NDArray[Any]]:
        """The batch as padded rows for a trainer, one per rollout in batch order: input ids,
        attention mask, position ids, loss mask, behaviour logprobs, token versions, rewards
        and GRPO advantages (see :class:`TrainArrays`; ``.to_torch()`` for tensors).

        Rows are as wide as the longest sequence (prompt and response), rounded up to a
        multiple of ``pad_to_multiple_of``, and padded with ``pad_id`` on ``padding_side``. A
        sequence longer than ``max_length`` raises ValueError naming its rollout: it is never
        cut. ``max_length=n, pad_to_multiple_of=n`` gives rows of exactly ``n`` tokens.
        Advantages are divided by their group's std plus ``eps``, or not with
        ``scale_by_std=False`` (Dr. GRPO)."""
        return pad(
            self.rollouts,
            pad_id,
            max_length=max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
            scale_by_std=scale_by_std,
            eps=eps,
        )

    def packed(
        self, *, scale_by_std: bool = True, eps: float = 1e-6
    ) -> PackedArrays[npt.NDArray[Any]]:
        """The batch packed into one row without padding, for variable-length attention
        (flash-attn's ``varlen`` functions): the per-token arrays of :meth:`padded`
        concatenated, with ``cu_seqlens`` and ``max_seqlen`` (see :class:`PackedArrays`;
        ``.to_torch()`` for tensors)."""
        return pack(self.rollouts, scale_by_std=scale_by_std, eps=eps)

    def ack_with(
        self,
        logprobs: LogprobsArg | None = None,
        *,
        kl: Mapping[str, float] | Sequence[float] | None = None,
        step: int | None = None,
    ) -> None:
        """Set what the ack carries: per-rollout logprobs of the current policy on the same
        tokens (a mapping by rollout_id, or a sequence in batch order), or per-rollout KL values,
        and the trainer's step. Call again to replace them."""
        self._ack = AckArgs(
            logprobs=self._by_id(logprobs) if logprobs is not None else None,
            kl={k: float(v) for k, v in self._by_id(kl).items()} if kl is not None else None,
            step=step,
        )

    def pending_ack(self) -> AckArgs:
        """What the ack on leaving the lease will carry."""
        return self._ack

    def _by_id(self, values: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(values, Mapping):
            return dict(values)
        if len(values) != len(self.rollouts):
            raise ValueError(
                f"{len(values)} values for a batch of {len(self.rollouts)} rollouts; give one "
                "per rollout, in batch order, or a mapping by rollout_id"
            )
        return {r.rollout_id: v for r, v in zip(self.rollouts, values, strict=True)}


ConsumerKind = Literal["rollouts", "preferences"]
ConsumerSource = Literal["received", "trained"]
PairRule = Literal["best_worst", "all"]


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    """A consumer of a run (SPEC "Consumers"): its config and its live counts, of rollouts or,
    for kind ``preferences``, of pairs. ``pending`` are delivered and neither acked nor dropped
    (``leased`` among them); ``dropped`` were too far behind (``max_lag``) or beyond
    ``retention_rollouts``."""

    name: str
    kind: ConsumerKind
    source: ConsumerSource
    max_lag: int | None
    min_margin: float | None  # kind preferences only
    pairs: PairRule | None  # kind preferences only
    retention_rollouts: int
    created_at: datetime
    delivered: int
    acked: int
    dropped: int
    pending: int
    leased: int


@dataclass(frozen=True, slots=True, eq=False)
class ConsumerRollout(_Masked):
    """A scored rollout as a consumer receives it, its arrays as numpy (as a trainer's
    :class:`LeasedRollout`, without the policy trainer's ``uses`` and ``lag``). Compared by
    identity, as its arrays cannot be compared by value."""

    rollout_id: str
    group_id: str | None
    policy_version: int
    prompt_ids: Int32Array | None
    response_ids: Int32Array
    logprobs: Float32Array | None
    reward: float
    loss_mask: UInt8Array | None = None  # None: every token is trained
    versions: tuple[tuple[int, int], ...] = ()
    generator_id: str | None = None
    finish_reason: FinishReason | None = None
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Pair:
    """A preference pair from one complete group: ``chosen`` has the higher reward, by
    ``margin``. ``pair_id`` is the same when the pair is handed out again."""

    pair_id: str
    prompt_id: str | None  # the prompt of a group posted under a work lease
    chosen: ConsumerRollout
    rejected: ConsumerRollout
    margin: float


@dataclass(slots=True, eq=False)
class ConsumerBatch:
    """A consumer's leased batch: :attr:`rollouts` for kind ``rollouts``, :attr:`pairs` for kind
    ``preferences`` (the other list empty). Ack it once used, nack it to have its items handed
    out again; the consumer's loop does either for you."""

    batch_id: str
    lease_expires_at: datetime
    rollouts: list[ConsumerRollout] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)

    def __len__(self) -> int:
        """The batch's items: rollouts, or pairs."""
        return len(self.pairs) or len(self.rollouts)

    def rewards(self) -> npt.NDArray[np.float64]:
        """The rewards of :attr:`rollouts`, in batch order."""
        return np.array([r.reward for r in self.rollouts], dtype=np.float64)

    def margins(self) -> npt.NDArray[np.float64]:
        """The reward margin of each pair, in batch order (a weight for a preference loss)."""
        return np.array([p.margin for p in self.pairs], dtype=np.float64)

    def chosen(self) -> list[ConsumerRollout]:
        """The preferred rollout of each pair, in batch order."""
        return [p.chosen for p in self.pairs]

    def rejected(self) -> list[ConsumerRollout]:
        """The other rollout of each pair, in batch order: ``chosen()[i]`` beat
        ``rejected()[i]``."""
        return [p.rejected for p in self.pairs]


@dataclass(frozen=True, slots=True)
class BatchCounts:
    leased: int
    acked: int
    nacked: int
    expired: int


@dataclass(frozen=True, slots=True)
class LagStats:
    mean: float | None
    max: int | None
    histogram: dict[int, int]
    token_mean: float | None = None  # over trained tokens, each by its own version


@dataclass(frozen=True, slots=True)
class KlStats:
    mean: float | None
    max: float | None


@dataclass(frozen=True, slots=True)
class IsRatioStats:
    mean: float | None
    clip_fraction: float | None


@dataclass(frozen=True, slots=True)
class PromptCounts:
    """Prompt passes of a run that takes its work from the broker (a prompt registered for
    ``epochs`` passes counts ``epochs`` times); ``retried`` counts attempts after the first."""

    registered: int = 0
    queued: int = 0
    in_flight: int = 0
    done: int = 0  # the skipped and cancelled passes too
    failed: int = 0
    retried: int = 0
    skipped: int = 0  # of done: skipped without generation (a difficulty pool of weight 0)
    cancelled: int = 0  # of done: cancelled without generation (their run closed)
    # Queued passes per difficulty pool ({"easy", "normal", "hard"}); None without difficulty.
    pools: dict[str, int] | None = None

    @property
    def unaccounted(self) -> int:
        """``registered - queued - in_flight - done - failed``: 0 once caught up."""
        return self.registered - self.queued - self.in_flight - self.done - self.failed


@dataclass(frozen=True, slots=True)
class WaitStats:
    """Seconds generators waited for budget or prompts, and trainers for rollouts, in all."""

    generator_s: float = 0.0
    trainer_s: float = 0.0
    reward_s: float | None = None  # ingest to score, summed; None from a broker without it


@dataclass(frozen=True, slots=True)
class RewardCounts:
    """Rollouts posted without a reward (SPEC "Rewards"): ``awaiting`` a reward lease,
    ``leased`` to a reward worker, ``scored`` through the rewards endpoint, and ``timed_out``
    counts each expiry of a reward lease once per unscored rollout in it."""

    awaiting: int = 0
    leased: int = 0
    scored: int = 0
    timed_out: int = 0


@dataclass(frozen=True, slots=True)
class PartialCounts:
    """Partial rollouts given back with their prompts (SPEC "Partial rollouts"): how many came
    back, were handed out again to be continued (resumed) or were dropped, and the response
    tokens of those resumed and dropped."""

    returned: int = 0
    resumed: int = 0
    dropped: int = 0
    tokens_resumed: int = 0
    tokens_dropped: int = 0


def reward_counts(value: Mapping[str, Any]) -> RewardCounts:
    """The ``rewards`` object of an accounting answer (a figure it lacks reads 0)."""
    return RewardCounts(
        **{k: int(value.get(k) or 0) for k in ("awaiting", "leased", "scored", "timed_out")}
    )


def partial_counts(value: Mapping[str, Any]) -> PartialCounts:
    """The ``partials`` object of an accounting answer (a figure it lacks reads 0)."""
    return PartialCounts(
        **{
            k: int(value.get(k) or 0)
            for k in ("returned", "resumed", "dropped", "tokens_resumed", "tokens_dropped")
        }
    )


@dataclass(frozen=True, slots=True)
class LengthBias:
    """Trained-token lengths of the rollouts received (``generated``) against those of the
    samples consumed (``trained``): their means, the Kolmogorov-Smirnov distance between the two
    distributions (0 the same, 1 disjoint) and the two log-spaced histograms (each bucket's
    first length -> rollouts in it). A figure with nothing to read is None."""

    generated_mean: float | None = None
    trained_mean: float | None = None
    ks: float | None = None
    generated: dict[int, int] = field(default_factory=dict)
    trained: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RewardBias:
    """Mean reward of the rollouts received (posted with it or scored later) and of the
    samples consumed; None with none to average."""

    generated_mean: float | None = None
    trained_mean: float | None = None


@dataclass(frozen=True, slots=True)
class BiasStats:
    """Whether a run trains on a biased share of what it generates (SPEC "Accounting")."""

    length: LengthBias = field(default_factory=LengthBias)
    reward: RewardBias = field(default_factory=RewardBias)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def bias_stats(value: Mapping[str, Any]) -> BiasStats:
    """The ``bias`` object of an accounting answer (a figure it lacks reads None)."""
    length, reward = value.get("length") or {}, value.get("reward") or {}
    hist = length.get("histogram") or {}
    return BiasStats(
        length=LengthBias(
            generated_mean=_opt_float(length.get("generated_mean")),
            trained_mean=_opt_float(length.get("trained_mean")),
            ks=_opt_float(length.get("ks")),
            generated={int(k): int(n) for k, n in (hist.get("generated") or {}).items()},
            trained={int(k): int(n) for k, n in (hist.get("trained") or {}).items()},
        ),
        reward=RewardBias(
            generated_mean=_opt_float(reward.get("generated_mean")),
            trained_mean=_opt_float(reward.get("trained_mean")),
        ),
    )


@dataclass(frozen=True, slots=True)
class ConsumerCounts:
    """One consumer's items (SPEC "Consumers"), summed over every consumer of its name:
    ``delivered`` to it, ``acked`` by it, ``pending`` (delivered - acked - dropped: queued for
    it or in its live leases) and ``dropped`` (beyond its retention_rollouts, beyond its
    max_lag when leased, or held when it was deleted)."""

    delivered: int = 0
    acked: int = 0
    pending: int = 0
    dropped: int = 0


def consumer_counts(value: Mapping[str, Any]) -> dict[str, ConsumerCounts]:
    """The ``consumers`` object of an accounting answer, by name (a figure it lacks reads 0)."""
    return {
        name: ConsumerCounts(
            **{k: int(c.get(k) or 0) for k in ("delivered", "acked", "pending", "dropped")}
        )
        for name, c in value.items()
    }


@dataclass(frozen=True, slots=True)
class LiveCounts:
    """The broker's own counts of a run's rollouts, from its live state rather than the ledger;
    ``rewards_awaiting`` and ``rewards_leased`` are 0 from a server that does not report them."""

    buffered: int
    leased: int
    rewards_awaiting: int = 0
    rewards_leased: int = 0


@dataclass(frozen=True, slots=True)
class Accounting:
    """A run's accounting (SPEC "Accounting"). ``pending_events`` is how many state changes the
    broker has made that the accounting has not caught up with (None if the server does not say);
    the invariants hold once it is 0. ``prompts`` and ``wait`` are zeros from a server that does
    not report them. ``tokens_masked`` (of ``tokens_generated``, those posted with loss_mask 0)
    and ``tokens_masked_stale`` (trained tokens handed out masked for their own lag) are 0 from
    a server that does not report them, and so is ``samples_rewound`` (of ``samples_consumed``,
    the uses a rewind of the policy version gave back to their rollouts). ``dead_letters``
    (events the ledger could not apply), ``live`` (the broker's own buffered and leased counts),
    ``partials``, ``rewards``, ``bias`` and ``consumers`` (by name; empty for a run with none)
    are None from a server that does not report them; when not given they are read from
    ``raw``. ``raw`` is the server's body as it came."""

    rollouts_received: int
    groups_received: int
    duplicates: int
    rejected: dict[str, int]
    tokens_generated: int
    buffered: int
    leased: int
    samples_consumed: int
    tokens_consumed: int
    reuse_factor: float
    retired: dict[str, int]
    wasted_tokens: int
    batches: BatchCounts
    lag: LagStats
    kl: KlStats
    is_ratio: IsRatioStats
    prompts: PromptCounts = field(default_factory=PromptCounts)
    wait: WaitStats = field(default_factory=WaitStats)
    tokens_masked: int = 0
    tokens_masked_stale: int = 0
    samples_rewound: int = 0
    pending_events: int | None = None
    as_of: datetime | None = None
    dead_letters: int | None = None
    live: LiveCounts | None = None
    partials: PartialCounts | None = None
    rewards: RewardCounts | None = None
    kl_coef: float | None = None  # β of the adaptive KL penalty after the newest ack
    bias: BiasStats | None = None
    consumers: dict[str, ConsumerCounts] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dead_letters is None and self.raw.get("dead_letters") is not None:
            object.__setattr__(self, "dead_letters", int(self.raw["dead_letters"]))
        live = self.raw.get("live")
        if self.live is None and isinstance(live, Mapping):
            awaiting = live.get("rewards") or {}
            live_counts = LiveCounts(
                buffered=int(live["buffered"]),
                leased=int(live["leased"]),
                rewards_awaiting=int(awaiting.get("awaiting") or 0),
                rewards_leased=int(awaiting.get("leased") or 0),
            )
            object.__setattr__(self, "live", live_counts)
        partials = self.raw.get("partials")
        if self.partials is None and isinstance(partials, Mapping):
            object.__setattr__(self, "partials", partial_counts(partials))
        rewards = self.raw.get("rewards")
        if self.rewards is None and isinstance(rewards, Mapping):
            object.__setattr__(self, "rewards", reward_counts(rewards))
        bias = self.raw.get("bias")
        if self.bias is None and isinstance(bias, Mapping):
            object.__setattr__(self, "bias", bias_stats(bias))
        consumers = self.raw.get("consumers")
        if self.consumers is None and isinstance(consumers, Mapping):
            object.__setattr__(self, "consumers", consumer_counts(consumers))

    @property
    def mean_reward_wait_s(self) -> float | None:
        """Mean seconds from ingest to score over the rollouts scored; None before the first,
        or from a broker that does not report them."""
        if self.rewards is None or self.wait.reward_s is None or not self.rewards.scored:
            return None
        return self.wait.reward_s / self.rewards.scored

    @property
    def retired_total(self) -> int:
        return sum(self.retired.values())

    @property
    def unaccounted(self) -> int:
        """``rollouts_received - buffered - leased - Σ retired``: 0 once caught up."""
        return self.rollouts_received - self.buffered - self.leased - self.retired_total

    @property
    def matches_live(self) -> bool:
        """The ledger is checked and right: caught up (``pending_events == 0``), no dead
        letters, and its buffered and leased, and its rollouts awaiting a reward (in no reward
        lease and in one), equal the broker's live counts. False whenever the server does not
        say enough to tell."""
        rewards = self.rewards or RewardCounts()
        return (
            self.pending_events == 0
            and self.dead_letters == 0
            and self.live is not None
            and (self.buffered, self.leased, rewards.awaiting, rewards.leased)
            == (
                self.live.buffered,
                self.live.leased,
                self.live.rewards_awaiting,
                self.live.rewards_leased,
            )
        )

    @property
    def rewards_match_live(self) -> bool | None:
        """Whether the ledger's rollouts awaiting a reward (in no reward lease, and in one)
        equal the broker's live counts; None from a broker that reports no reward figures."""
        if self.rewards is None or self.live is None:
            return None
        live = (self.live.rewards_awaiting, self.live.rewards_leased)
        return (self.rewards.awaiting, self.rewards.leased) == live


@dataclass(frozen=True, slots=True)
class VersionAccounting:
    """The accounting of the rollouts one policy version generated."""

    policy_version: int
    rollouts_received: int
    groups_received: int
    rejected: dict[str, int]
    tokens_generated: int
    buffered: int
    leased: int
    samples_consumed: int
    tokens_consumed: int
    reuse_factor: float
    retired: dict[str, int]
    wasted_tokens: int
    lag: LagStats
    kl: KlStats
    tokens_masked: int = 0
    tokens_masked_stale: int = 0
    samples_rewound: int = 0
    kl_coef: float | None = None  # β after the newest ack of a batch leased at this version
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class TrainingVersion:
    """The acknowledged batches leased at one policy version of the trainer (the batches' V,
    whatever versions their rollouts came from), with the KL and importance ratios of their
    acks; the means and ``clip_fraction`` are None when no token was measured."""

    policy_version: int
    batches: int
    samples: int
    tokens: int
    kl_mean: float | None
    kl_max: float | None
    is_ratio_mean: float | None
    clip_fraction: float | None
    kl_coef: float | None = None  # β after the newest ack at this version
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class GeneratorAccounting:
    """One generator's rollouts, their uses (less those a rewind undid) and the mismatch
    measured on them; the means, ``clip_fraction`` and ``masked_fraction`` are None when none
    of its tokens was measured."""

    generator_id: str
    rollouts: int
    tokens: int
    samples_consumed: int
    kl: KlStats
    is_ratio: IsRatioStats
    masked_fraction: float | None
    last_seen: datetime | None
    quarantined: bool
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


Scope = Literal["generate", "reward", "train", "operate", "admin"]
"""What an access token may do (SPEC "Access control"): ``generate`` posts rollouts and takes
and returns work; ``reward`` leases rollouts to score and posts their rewards; ``train``
leases, acks, nacks and sets the policy version; ``operate`` creates, changes, closes and
deletes runs, registers prompts and reads the accounting and the audit log; ``admin`` manages
tokens, and may do everything. Any scope reads its runs."""


@dataclass(frozen=True, slots=True)
class AccessToken:
    """An access token as the broker lists it: never its secret. ``runs`` are the run ids and
    ``prefix*`` patterns it may touch (None: every run); ``created_by`` names the token that
    created it; ``revoked_at`` is set once it is revoked."""

    token_id: str
    name: str
    scopes: list[Scope]
    runs: list[str] | None
    created_at: datetime
    created_by: str | None
    revoked_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True, slots=True)
class NewToken:
    """A token just created. ``token`` is its secret, to pass as ``token=`` (or
    ``BROKER_TOKEN``): the broker shows it in this answer only and keeps just a digest. It is
    left out of the repr, so printing or logging the object does not reveal it."""

    token_id: str
    token: str = field(repr=False)
    name: str
    scopes: list[Scope]
    runs: list[str] | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One operator action: ``actor`` (the name of the token that acted; ``anonymous`` with
    auth off) did ``action`` (``run.create``, ``run.config``, ``run.close``, ``run.delete``,
    ``run.policy``, ``token.create``, ``token.revoke``) to ``run_id`` (None for a token
    action) at ``at``, with ``detail`` (the config, the version, the token id...).
    ``token_id`` is the id of the token that acted (``bootstrap`` for the broker's admin token,
    None with auth off): a name is unique only among live tokens, so a revoked token's name may
    name another token later."""

    id: int
    at: datetime
    actor: str
    token_id: str | None
    action: str
    run_id: str | None
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class AuditPage:
    """A page of the audit log, newest first; ``next_cursor`` asks for the next (None: the
    last page)."""

    entries: list[AuditEntry]
    next_cursor: str | None

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[AuditEntry]:
        return iter(self.entries)
