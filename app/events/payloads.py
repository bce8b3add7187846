"""The declaration of the accounting events' payloads: one frozen dataclass per payload, item and
map, whose ``wire(...)`` fields say how each is written (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from app.events.prompt_payloads import (
    PartialItem,
    PartialsChanged,
    PassesChanged,
    PassItem,
    PromptScored,
    PromptScoredItem,
    Registered,
    RegisteredItem,
    WorkItem,
    WorkLeased,
)
from app.events.wire import (
    MAX_TEXT,
    EventError,
    StreamId,
    Wire,
    _wire_class,
    text_fault,
    wire,
)

# Re-exported: the codec reads the machinery and the payloads from here.
__all__ = [
    "MAX_TEXT",
    "EventError",
    "PartialItem",
    "PartialsChanged",
    "PassItem",
    "PassesChanged",
    "PromptScored",
    "PromptScoredItem",
    "Registered",
    "RegisteredItem",
    "StreamId",
    "Wire",
    "WorkItem",
    "WorkLeased",
    "text_fault",
    "wire",
]


def lag_of(batch_version: int, rollout_version: int) -> int:
    """A rollout's lag in a batch: the batch's (trainer's) policy version minus the rollout's.

    lease.lua writes it into each ``leased`` item (and into the lease's reply); an ``acked``
    item does not carry it, so the fold derives a sample's lag here from the ``acked`` event's
    own ``policy_version``. It cannot borrow it from the batch's ``leased`` event, which may be
    applied in another transaction (folding is order-free). tests/accounting/test_event_schema.py
    checks that every ``leased`` item the scripts write carries exactly this value.
    """
    return batch_version - rollout_version


# --- payload types ---------------------------------------------------------------------------


@_wire_class
class RunChanged:
    run_id: str = wire("text")
    change: str = wire("text", note="`created`, `config`, `policy`, `closed`")
    config: dict[str, Any] = wire("map", note="map, the full RunConfig")
    policy_version: int = wire("int")
    status: str = wire("text", note="`open`/`closed`")
    created_at_ms: int = wire("int", key="created_at", minimum=0, note="ms")


@_wire_class
class AcceptedItem:
    rollout_id: str = wire("text")
    unit_id: str = wire("text")
    policy_version: int = wire("int")
    tokens: int = wire("int", minimum=0)
    new_unit: bool = wire("flag")
    masked: int = wire(
        "int", optional=True, minimum=0, default=0, note="of `tokens`, those with loss_mask 0"
    )
    awaiting: bool = wire(
        "flag", optional=True, default=False, note="1: posted without a reward (absent: 0)"
    )
    generator: str | None = wire(
        "text", optional=True, default=None, note="its `generator_id` (absent: none)"
    )


@_wire_class
class Accepted:
    items: tuple[AcceptedItem, ...] = wire("items", of=AcceptedItem)
    rewarded: int | None = wire(
        "int",
        optional=True,
        minimum=1,
        default=None,
        note="of the items, those posted with a reward (absent: none)",
    )
    reward_sum: float | None = wire(
        "float", optional=True, default=None, note="Σ of their rewards (absent: none)"
    )


@_wire_class
class Duplicate:
    n: int = wire("int", minimum=0, note="the number of `ids`")
    ids: tuple[str, ...] = wire(
        "texts", optional=True, default=(), note="the repeated `rollout_id`s"
    )


@_wire_class
class RejectedItem:
    rollout_id: str = wire("text")
    reason: str = wire("text")
    policy_version: int = wire("int")
    tokens: int = wire("int", minimum=0)


@_wire_class
class Rejected:
    items: tuple[RejectedItem, ...] = wire("items", of=RejectedItem)


@_wire_class
class LeasedItem:
    rollout_id: str = wire("text")
    policy_version: int = wire("int")
    tokens: int = wire("int", minimum=0)
    lag: int = wire("int")  # lag_of(the batch's policy_version, policy_version)
    uses_before: int = wire("int", minimum=0)


@_wire_class
class Leased:
    batch_id: str = wire("text")
    trainer_id: str | None = wire("text", optional=True, note="str or nil")
    policy_version: int = wire("int", note="the batch's V")
    expires_at_ms: int = wire("int", key="expires_at", minimum=0, note="ms")
    items: tuple[LeasedItem, ...] = wire("items", of=LeasedItem)
    wait_ms: int = wire(
        "int",
        optional=True,
        minimum=0,
        default=0,
        note="ms the trainer's request waited for rollouts before this lease",
    )


@_wire_class
class AckedItem:
    rollout_id: str = wire("text")
    policy_version: int = wire("int")
    tokens: int = wire("int", minimum=0, note="trained tokens, as handed out")
    kl: float | None = wire("float", optional=True)
    masked_stale: int = wire(
        "int", optional=True, minimum=0, default=0, note="trained tokens masked at hand-out"
    )
    lag_tokens: int | None = wire(
        "int",
        optional=True,
        minimum=0,
        default=None,
        note="Σ over trained tokens of their own lag (absent: every token at `policy_version`)",
    )
    reward: float | None = wire(
        "float", optional=True, default=None, note="the rollout's reward (absent: not told)"
    )


@_wire_class
class AckStats:
    kl_mean: float | None = wire("float", optional=True, default=None)
    kl_max: float | None = wire("float", optional=True, default=None)
    is_ratio_mean: float | None = wire("float", optional=True, default=None)
    clip_fraction: float | None = wire("float", optional=True, default=None)
    ess_fraction: float | None = wire("float", optional=True, default=None)


@_wire_class
class AckSums:
    kl_tokens: int = wire("int", optional=True, minimum=0, default=0)
    kl_sum: float = wire("float", optional=True, default=0.0)
    ratio_tokens: int = wire("int", optional=True, minimum=0, default=0)
    ratio_sum: float = wire("float", optional=True, default=0.0)
    clipped: int = wire("int", optional=True, minimum=0, default=0)


@_wire_class
class AckedGen:
    """One generator's share of an acked batch: its samples, and the figures of those measured
    (the sums of :class:`AckSums`, over its rollouts only)."""

    generator_id: str = wire("text")
    samples: int = wire("int", minimum=0)
    tokens: int = wire("int", minimum=0, note="trained tokens of its samples")
    kl_tokens: int = wire("int", minimum=0)
    kl_sum: float = wire("float")
    ratio_tokens: int = wire("int", minimum=0)
    ratio_sum: float = wire("float")
    clipped: int = wire("int", minimum=0)
    zero_weight: int = wire(
        "int",
        minimum=0,
        note="of `ratio_tokens`, those the run's `correction` gives weight 0",
    )
    kl_max: float | None = wire(
        "float", optional=True, default=None, note="its largest rollout KL (absent: none measured)"
    )


@_wire_class
class Acked:
    batch_id: str = wire("text")
    step: int | None = wire("int", optional=True, note="int, absent when not given")
    policy_version: int = wire("int")
    items: tuple[AckedItem, ...] = wire(
        "items", of=AckedItem, note="`kl` absent, a 3-element item, when not measured"
    )
    stats: AckStats = wire(
        "struct",
        of=AckStats,
        note="a figure that was not measured is absent; `stats` itself is absent when none was",
    )
    sums: AckSums = wire("struct", of=AckSums)
    gens: tuple[AckedGen, ...] = wire(
        "items",
        of=AckedGen,
        optional=True,
        default=(),
        note="per generator of its rollouts (those with a `generator_id`); absent: none",
    )
    kl_coef: float | None = wire(
        "float",
        optional=True,
        default=None,
        note="β after this ack (the adaptive KL penalty); absent when `kl_coef` is off",
    )


@_wire_class
class ReturnedItem:
    rollout_id: str = wire("text")
    policy_version: int = wire("int")
    tokens: int = wire("int", minimum=0)


@_wire_class
class Returned:
    """``nacked`` or ``expired``: leased rollouts back in the buffer without a use."""

    batch_id: str = wire("text")
    items: tuple[ReturnedItem, ...] = wire("items", of=ReturnedItem)


@_wire_class
class RetiredItem:
    rollout_id: str = wire("text")
    policy_version: int = wire("int")
    tokens: int = wire("int", minimum=0)
    uses: int = wire("int", minimum=0)
    unscored: int = wire(
        "int",
        optional=True,
        minimum=0,
        default=0,
        note="absent/0: it had its reward; 1: unscored, in no reward lease; 2: unscored, in a "
        "live reward lease",
    )


@_wire_class
class Retired:
    reason: str = wire("text")
    items: tuple[RetiredItem, ...] = wire("items", of=RetiredItem)


@_wire_class
class RewoundItem:
    rollout_id: str = wire("text")
    policy_version: int = wire("int", note="the rollout's, as in `acked` items")
    tokens: int = wire("int", minimum=0, note="its trained tokens in the undone batch")
    batch_version: int = wire("int", minimum=0, note="the undone batch's V")


@_wire_class
class RewoundGen:
    generator_id: str = wire("text")
    samples: int = wire("int", minimum=0, note="its uses the rewind undid")


@_wire_class
class Rewound:
    """A rewind of the run's policy version: the uses of acknowledged batches it undid."""

    from_version: int = wire("int", minimum=0, note="the run's version before")
    to_version: int = wire("int", minimum=0, note="`W`")
    batches: tuple[str, ...] = wire(
        "texts", note="the acknowledged batches undone: those acked at a version above `W`"
    )
    items: tuple[RewoundItem, ...] = wire(
        "items",
        of=RewoundItem,
        note="one per use undone: a rollout of two undone batches is there twice",
    )
    gens: tuple[RewoundGen, ...] = wire(
        "items",
        of=RewoundGen,
        optional=True,
        default=(),
        note="the uses undone per generator (as the undone batches' `acked` `gens` counted them)",
    )


@_wire_class
class RewardItem:
    rollout_id: str = wire("text")
    policy_version: int = wire("int")
    tokens: int = wire("int", minimum=0)


@_wire_class
class RewardLeased:
    lease_id: str = wire("text")
    worker_id: str | None = wire("text", optional=True, note="str, absent when none")
    expires_at_ms: int = wire("int", key="expires_at", minimum=0, note="ms")
    items: tuple[RewardItem, ...] = wire("items", of=RewardItem)
    wait_ms: int | None = wire(
        "int",
        optional=True,
        minimum=0,
        default=None,
        note="ms the reward worker's request waited, absent when not told",
    )


@_wire_class
class ScoredItem:
    rollout_id: str = wire("text")
    policy_version: int = wire("int")
    reward: float = wire("float")
    wait_ms: int = wire("int", minimum=0, note="ms from the rollout's ingest to its score")
    leased: bool = wire("flag", note="1: it was in a live reward lease")


@_wire_class
class Scored:
    items: tuple[ScoredItem, ...] = wire("items", of=ScoredItem)


@_wire_class
class RewardExpiredItem:
    rollout_id: str = wire("text")
    policy_version: int = wire("int")
    attempts: int = wire(
        "int", minimum=1, note="expiries of this rollout so far, this one included"
    )


@_wire_class
class RewardExpired:
    lease_id: str = wire("text")
    items: tuple[RewardExpiredItem, ...] = wire("items", of=RewardExpiredItem)


@_wire_class
class RewardReturned:
    lease_id: str = wire("text")
    items: tuple[RewardItem, ...] = wire("items", of=RewardItem)


@_wire_class
class GeneratorChanged:
    """A generator was quarantined (its mean KL over its window passed `generator_kl_max`) or
    released by an operator."""

    generator_id: str = wire("text")
    quarantined: bool = wire("flag", note="1: quarantined; 0: released")
    kl_mean: float | None = wire(
        "float", optional=True, default=None, note="the window's mean KL that quarantined it"
    )
    window_tokens: int | None = wire(
        "int", optional=True, minimum=0, default=None, note="the trained tokens of that window"
    )


@_wire_class
class ConsumerItem:
    name: str = wire("text", note="the consumer's name")
    delivered: int = wire("int", minimum=0, note="items delivered to it")
    acked: int = wire("int", minimum=0, note="items it acknowledged")
    dropped: int = wire(
        "int",
        minimum=0,
        note="items dropped: beyond `retention_rollouts`, below `max_lag` when leased, or "
        "pending or leased when it was deleted",
    )


@_wire_class
class ConsumersChanged:
    """What one call added to the counts of the consumers whose counts it changed."""

    items: tuple[ConsumerItem, ...] = wire("items", of=ConsumerItem)


@_wire_class
class Waited:
    role: str = wire("text", note="`trainer` or `generator`")
    wait_ms: int = wire("int", minimum=0)


Payload: TypeAlias = (
    RunChanged
    | Accepted
    | Duplicate
    | Rejected
    | Leased
    | Acked
    | Returned
    | Retired
    | Registered
    | Rewound
    | WorkLeased
    | PassesChanged
    | PartialsChanged
    | RewardLeased
    | Scored
    | RewardExpired
    | RewardReturned
    | GeneratorChanged
    | ConsumersChanged
    | PromptScored
    | Waited
)


@dataclass(frozen=True, slots=True)
class Event:
    """One decoded stream entry of one run."""

    run_id: str
    stream_id: StreamId
    type: str
    t_ms: int
    body: Payload
