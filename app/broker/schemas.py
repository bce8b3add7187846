"""Wire models of rollouts, batches and acks. JSON bodies carry arrays as lists; msgpack
bodies may also carry `response_ids`, `prompt_ids` (int32) and `logprobs` (float32) as raw
little-endian bytes."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.broker.config import MAX_EPOCHS, RunConfig, RunConfigPatch
from app.broker.stats import FIGURE_CAP
from app.ids import MAX_VERSION, ItemId, LeaseId, PromptId, RunId

FinishReason = Literal["stop", "length", "abort"]

# The lists of a body stop at their first invalid item: a list of a million bad items is one
# error, not a million (their number is bounded before the parse, app/api/_outline.py).
TokenIds = Annotated[list[int], Field(fail_fast=True)]
Floats = Annotated[list[float], Field(fail_fast=True)]
# A loss mask: 0/1 per response token (checked in app/broker/tokens.py, which names the rule).
Mask = Annotated[list[int], Field(fail_fast=True)]
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
# Run-length versions: [[offset, version], ...] (their order is checked in app/broker/tokens.py).
Versions = Annotated[
    list[Annotated[list[Version], Field(min_length=2, max_length=2)]],
    Field(fail_fast=True, min_length=1),
]


# The largest reward magnitude taken: the ledger sums rewards in doubles (the accounting's
# `bias.reward`), and sums of bounded rewards stay finite where two of 1e308 would not.
MAX_REWARD = 1e12
Reward = Annotated[float, Field(ge=-MAX_REWARD, le=MAX_REWARD, allow_inf_nan=False)]

MAX_METADATA_DEPTH = 16


def check_metadata(value: Any, depth: int = 0) -> None:
    """Metadata must survive JSON and msgpack unchanged: finite numbers, 64-bit integers,
    strings, booleans, null, lists and string-keyed objects, nested at most 16 deep."""
    if depth > MAX_METADATA_DEPTH:
        raise ValueError(f"metadata is nested deeper than {MAX_METADATA_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ValueError("metadata integers must fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("metadata numbers must be finite (no NaN or Infinity)")
    elif isinstance(value, list):
        for item in value:
            check_metadata(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError("metadata keys must be strings")
            check_metadata(item, depth + 1)
    else:
        raise ValueError(f"metadata cannot hold {type(value).__name__} values")


class RolloutJSON(BaseModel):
    # strict: "1.5" is not a reward and true is not a token id
    model_config = ConfigDict(extra="forbid", strict=True)

    rollout_id: ItemId
    group_id: ItemId | None = None
    policy_version: int = Field(ge=0, le=MAX_VERSION)
    prompt_ids: TokenIds | None = None
    response_ids: TokenIds
    logprobs: Floats | None = None
    loss_mask: Mask | None = None
    versions: Versions | None = None
    # null or absent: the rollout awaits its reward (SPEC "Rewards")
    reward: Reward | None = None
    generator_id: ItemId | None = None
    finish_reason: FinishReason | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            check_metadata(v)
        return v


class RolloutMsgpack(RolloutJSON):
    prompt_ids: TokenIds | bytes | None = None  # type: ignore[assignment]
    response_ids: TokenIds | bytes  # type: ignore[assignment]
    logprobs: Floats | bytes | None = None  # type: ignore[assignment]
    loss_mask: Mask | bytes | None = None  # type: ignore[assignment]


class IngestJSON(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rollouts: Annotated[list[RolloutJSON], Field(fail_fast=True)]


class IngestMsgpack(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rollouts: Annotated[list[RolloutMsgpack], Field(fail_fast=True)]


class Rejection(BaseModel):
    rollout_id: str
    reason: str


class IngestResult(BaseModel):
    accepted: int
    duplicates: int
    rejected: list[Rejection]


class CreateRun(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    run_id: RunId | None = None
    config: RunConfig | None = None


class Run(BaseModel):
    run_id: str
    config: RunConfig
    policy_version: int
    status: Literal["open", "closed"]
    created_at: str


class RunList(BaseModel):
    """A page of ``GET /v1/runs``, newest first; ``next_cursor`` fetches the next (null: no
    more)."""

    runs: list[Run]
    next_cursor: str | None


MAX_WEIGHTS_CHARS = 2048
# A location of weights: printable text, no control characters (a path or URI).
WEIGHTS_PATTERN = r"^[^\x00-\x1f\x7f]+$"


class PolicyUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: int = Field(ge=0, le=MAX_VERSION)
    weights: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_WEIGHTS_CHARS,
        pattern=WEIGHTS_PATTERN,
        description="Where the version's weights are (a path or URI), kept with the version",
    )
    rewind: bool = Field(
        default=False,
        description="Allow a version below the run's: move the run back to it (a trainer "
        "resuming from a checkpoint of that version)",
    )


class PolicyResult(BaseModel):
    policy_version: int
    evicted: int


class ReleaseResult(BaseModel):
    """A generator's quarantine lifted (``released``), or it was not quarantined."""

    generator_id: str
    released: bool


class PolicyOut(BaseModel):
    """A run's policy version as its followers read it."""

    policy_version: int
    weights: str | None = Field(description="Where the version's weights are, if it was told")
    set_at: str = Field(description="When the version was set (the run's creation for its first)")


# A trainer's ready-made KL of one rollout: a divergence (≥ 0), within the cap every measured
# figure saturates at (app/broker/stats.py), so sums over it stay finite.
ReadyKl = Annotated[float, Field(ge=0, le=FIGURE_CAP, allow_inf_nan=False)]


class AckBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    logprobs: dict[str, Floats] | None = None
    kl: dict[str, ReadyKl] | None = Field(
        None,
        description=f"Ready-made KL by rollout id, 0 to {FIGURE_CAP:g}, instead of logprobs",
    )
    step: int | None = Field(None, ge=0, le=MAX_VERSION)


class AckMsgpack(AckBody):
    logprobs: dict[str, Floats | bytes] | None = None  # type: ignore[assignment]


class BatchStats(BaseModel):
    kl_mean: float | None
    kl_max: float | None
    is_ratio_mean: float | None
    clip_fraction: float | None
    ess_fraction: float | None


class AckResult(BaseModel):
    consumed: int
    retired: int
    flushed: int
    stats: BatchStats
    kl_coef: float | None  # the adaptive KL penalty's β after this ack; null when off


class NackResult(BaseModel):
    returned: int


class MeasureBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    logprobs: dict[str, Floats]


class MeasureMsgpack(MeasureBody):
    logprobs: dict[str, Floats | bytes]  # type: ignore[assignment]


class MeasureStats(BatchStats):
    masked_fraction: float | None = Field(
        description="Share of the measured rollouts' trained tokens whose weight is 0"
    )
    chi2: float | None = Field(
        description="mean(ρ²) − 1 over the measured rollouts' sequence ratios ρ, normalised to "
        "mean 1"
    )


class MeasureResult(BaseModel):
    weights: dict[str, list[float]] = Field(
        description="Per rollout, one weight per response token (0 on tokens not trained)"
    )
    sequence_weights: dict[str, float]
    stats: MeasureStats
    kl_coef: float | None  # the adaptive KL penalty's β to use now; null when off


__all__ = [
    "AckBody",
    "AckMsgpack",
    "AckResult",
    "BatchStats",
    "CreateRun",
    "IngestJSON",
    "IngestMsgpack",
    "IngestResult",
    "MeasureBody",
    "MeasureMsgpack",
    "MeasureResult",
    "MeasureStats",
    "NackResult",
    "PolicyOut",
    "PolicyResult",
    "PolicyUpdate",
    "Rejection",
    "RolloutJSON",
    "RolloutMsgpack",
    "Run",
    "RunConfigPatch",
]


class LeasedRolloutOut(BaseModel):
    """A rollout as a trainer receives it (msgpack responses carry the arrays as raw bytes)."""

    rollout_id: str
    group_id: str | None
    policy_version: int
    prompt_ids: list[int] | None
    response_ids: list[int]
    logprobs: list[float] | None
    loss_mask: list[int] | None = Field(
        description="0 for the tokens not to train on (null: every token is trained); under "
        "stale_tokens 'mask' the tokens too stale at hand-out are 0 as well"
    )
    versions: list[list[int]] = Field(description="[[offset, version], ...] of the tokens")
    reward: float
    generator_id: str | None
    finish_reason: FinishReason | None
    metadata: dict[str, Any] | None
    uses: int
    lag: int
    prompt_id: str | None = Field(
        None, description="The prompt of a rollout posted under a work lease (absent otherwise)"
    )


class BatchOut(BaseModel):
    batch_id: str
    policy_version: int
    lease_expires_at: str
    kl_coef: float | None  # the adaptive KL penalty's β to train this batch with; null when off
    rollouts: list[LeasedRolloutOut]


# -- prompts and work leases ------------------------------------------------------------------
class PromptJSON(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt_id: PromptId
    prompt_ids: TokenIds | None = None
    data: dict[str, Any] | None = None

    @field_validator("data")
    @classmethod
    def _data(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            check_metadata(v)
        return v


class PromptsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompts: Annotated[list[PromptJSON], Field(fail_fast=True)]
    epochs: int = Field(1, ge=1, le=MAX_EPOCHS)


class PromptsResult(BaseModel):
    accepted: int
    duplicates: int


class WorkBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    max_prompts: int = Field(ge=1, le=65536)
    generator_id: ItemId | None = None
    wait_s: float = Field(0.0, ge=0, le=3600, allow_inf_nan=False)
    lease_id: LeaseId | None = Field(
        None, description="Client-chosen id: retrying the call returns the same work lease"
    )


class PartialOut(BaseModel):
    """A partial rollout handed out for its prompt, under the attempt's group_id."""

    rollout_id: str
    group_id: str
    policy_version: int
    prompt_ids: list[int] | None
    response_ids: list[int]
    logprobs: list[float] | None
    loss_mask: list[int] | None = Field(description="0/1 per token; null: every token trained")
    versions: list[list[int]] | None = Field(description="[[offset, version], ...]; null: one")
    generator_id: str | None
    finish_reason: FinishReason | None
    metadata: dict[str, Any] | None


class WorkPrompt(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    prompt_id: str
    pass_: int = Field(alias="pass", description="1..epochs")
    attempt: int
    group_id: str = Field(description="post this attempt's rollouts with this group_id")
    prompt_ids: list[int] | None
    data: dict[str, Any] | None
    partials: list[PartialOut] = Field(
        default_factory=list,
        description="Partial rollouts to continue: post each completed under its rollout_id",
    )


class WorkOut(BaseModel):
    lease_id: str
    policy_version: int
    expires_at: str
    prompts: list[WorkPrompt]


class PartialJSON(RolloutJSON):
    """A partial rollout: a Rollout without reward, sampled so far (SPEC "Partial rollouts"),
    under the group_id of its prompt's attempt."""

    group_id: ItemId
    reward: None = None


class PartialMsgpack(RolloutMsgpack):
    group_id: ItemId
    reward: None = None


class ReturnBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt_ids: Annotated[list[PromptId], Field(fail_fast=True)] | None = Field(
        None, max_length=65536
    )
    partials: Annotated[list[PartialJSON], Field(fail_fast=True)] | None = Field(
        None,
        description="What was sampled so far of returned prompts' responses, each under its "
        "prompt's group_id: the lease that next hands the prompt out carries them",
    )


class ReturnMsgpack(ReturnBody):
    partials: Annotated[list[PartialMsgpack], Field(fail_fast=True)] | None = None  # type: ignore[assignment]


class ReturnResult(BaseModel):
    returned: int


# -- rewards (SPEC "Rewards") -----------------------------------------------------------------
class RewardLeaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    max_rollouts: int = Field(ge=1, le=65536)
    worker_id: ItemId | None = None
    wait_s: float = Field(0.0, ge=0, le=3600, allow_inf_nan=False)
    lease_id: LeaseId | None = Field(
        None, description="Client-chosen id: retrying the call returns the same reward lease"
    )


class RewardRolloutOut(BaseModel):
    """A rollout handed out to be scored (msgpack answers carry the arrays as raw bytes)."""

    rollout_id: str
    group_id: str | None
    prompt_id: str | None = Field(
        None, description="The prompt of a rollout posted under a work lease (absent otherwise)"
    )
    prompt_ids: list[int] | None
    response_ids: list[int]
    loss_mask: list[int] | None = Field(description="0/1 per token; null: every token trained")
    data: Any = Field(None, description="The registered prompt's data (absent otherwise)")
    metadata: dict[str, Any] | None
    finish_reason: FinishReason | None


class RewardLeaseOut(BaseModel):
    lease_id: str
    expires_at: str
    rollouts: list[RewardRolloutOut]


def _finite(rewards: dict[str, float]) -> dict[str, float]:
    for rid, value in rewards.items():
        if not math.isfinite(value):
            raise ValueError(f"the reward of rollout {rid!r} is not finite")
    return rewards


class ScoreBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rewards: dict[ItemId, Reward] = Field(
        max_length=65536, description="rollout_id -> its reward (finite, |reward| ≤ 1e12)"
    )
    lease_id: LeaseId | None = Field(None, description="The reward lease the rollouts are of")

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, v: dict[str, float]) -> dict[str, float]:
        return _finite(v)


class ScoreResult(BaseModel):
    scored: int
    duplicates: int
    retired: list[str] = Field(
        description="Rollouts that had retired (stale, the run closed, ...) before their reward "
        "came: nothing to do for them"
    )


class RewardReturnBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rollout_ids: Annotated[list[ItemId], Field(fail_fast=True)] | None = Field(
        None, max_length=65536, description="Give back the groups of these (absent: all)"
    )
