"""Wire models of consumers (SPEC "Consumers"): a consumer's creation and view, its batches of
rollouts or preference pairs, and its acks and nacks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.broker.consumer_calls import DEFAULT_RETENTION
from app.broker.schemas import FinishReason
from app.ids import ConsumerName

__all__ = [
    "DEFAULT_RETENTION",
    "MAX_RETENTION",
    "ConsumerAckResult",
    "ConsumerBatchOut",
    "ConsumerBody",
    "ConsumerNackResult",
    "ConsumerOut",
    "ConsumerRolloutOut",
    "PairOut",
]

MAX_RETENTION = 10_000_000  # a bound on what one consumer may hold: docs/design.md, "Consumers"

Kind = Literal["rollouts", "preferences"]
Source = Literal["received", "trained"]
PairRule = Literal["best_worst", "all"]


class ConsumerBody(BaseModel):
    """``POST /v1/runs/{run_id}/consumers``. ``min_margin`` and ``pairs`` apply to kind
    ``preferences`` alone (defaults 0 and ``best_worst``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: ConsumerName
    kind: Kind = "rollouts"
    source: Source
    max_lag: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="Items of rollouts more than this many versions behind the run's "
        "version when handed out are dropped (counted); null: none are",
    )
    min_margin: Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)] | None = Field(
        None, description="Kind preferences: the least reward difference of a pair (default 0)"
    )
    pairs: PairRule | None = Field(
        None,
        description="Kind preferences: one pair per group (best_worst, the default) or "
        "every pair whose rewards differ by min_margin or more (all)",
    )
    retention_rollouts: Annotated[int, Field(ge=1, le=MAX_RETENTION)] = DEFAULT_RETENTION

    @model_validator(mode="after")
    def _pairs_for_preferences(self) -> ConsumerBody:
        if self.kind == "rollouts" and (self.min_margin is not None or self.pairs is not None):
            raise ValueError("min_margin and pairs apply to kind preferences only")
        if self.kind == "preferences":
            if self.min_margin is None:
                self.min_margin = 0.0
            if self.pairs is None:
                self.pairs = "best_worst"
        return self


class ConsumerOut(BaseModel):
    """A consumer: its config and its live counts (items: rollouts, or pairs for kind
    preferences). ``pending`` are delivered, neither acked nor dropped (``leased`` among them)."""

    name: str
    kind: Kind
    source: Source
    max_lag: int | None
    min_margin: float | None
    pairs: PairRule | None
    retention_rollouts: int
    created_at: str
    delivered: int
    acked: int
    dropped: int
    pending: int
    leased: int


class ConsumerRolloutOut(BaseModel):
    """A rollout as a consumer receives it (msgpack responses carry the arrays as raw bytes)."""

    rollout_id: str
    group_id: str | None
    policy_version: int
    prompt_ids: list[int] | None
    response_ids: list[int]
    logprobs: list[float] | None
    loss_mask: list[int] | None = Field(
        description="0 for the tokens not to train on (null: every token is trained)"
    )
    versions: list[list[int]] = Field(description="[[offset, version], ...] of the tokens")
    reward: float
    generator_id: str | None
    finish_reason: FinishReason | None
    metadata: dict[str, Any] | None


class PairOut(BaseModel):
    """A preference pair from one complete group: ``chosen`` has the higher reward."""

    pair_id: str = Field(description="Unique in the consumer; the same when handed out again")
    prompt_id: str | None = Field(
        None, description="The prompt of a group posted under a work lease (absent otherwise)"
    )
    chosen: ConsumerRolloutOut
    rejected: ConsumerRolloutOut
    margin: float = Field(description="chosen's reward minus rejected's")


class ConsumerBatchOut(BaseModel):
    """A consumer's batch: ``rollouts`` for kind rollouts, ``pairs`` for kind preferences."""

    batch_id: str
    lease_expires_at: str
    rollouts: list[ConsumerRolloutOut] | None = None
    pairs: list[PairOut] | None = None


class ConsumerAckResult(BaseModel):
    acked: int  # the batch's items


class ConsumerNackResult(BaseModel):
    returned: int  # the items back to pending
