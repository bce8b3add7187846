"""What the store reads back from Redis: the states of runs, leases, batches, work leases and
the maintenance's calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from app.broker.config import RunConfig
from app.broker.replies import AckAnswer, text


@dataclass(frozen=True, slots=True)
class RunState:
    run_id: str
    config: RunConfig
    config_json: str
    policy_version: int
    status: Literal["open", "closed"]
    created_at_ms: int
    live: int  # buffered + leased rollouts
    leased: int
    floor: int


@dataclass(frozen=True, slots=True)
class PolicyState:
    """A run's policy version, where its weights are (None: not said), and when it was set."""

    policy_version: int
    weights: str | None
    set_at_ms: int


@dataclass(frozen=True, slots=True)
class RunPage:
    runs: list[RunState]
    next_cursor: str | None  # None: the listing is complete


MaintainState = Literal["active", "parked", "missing", "deleted"]


def maintain_state(state: str) -> MaintainState:
    """maintain.lua's first reply value, checked."""
    if state not in get_args(MaintainState):
        raise ValueError(f"maintain.lua answered an unknown state {state!r}")
    return cast(MaintainState, state)


@dataclass(frozen=True, slots=True)
class MaintainOutcome:
    state: MaintainState
    more: bool  # sweep work was left for another call
    retired: dict[str, int]
    now_ms: int  # Redis's clock, for the age of a missing run's index entry

    @property
    def total(self) -> int:
        return sum(self.retired.values())


@dataclass(frozen=True, slots=True)
class IngestOutcome:
    accepted: int
    duplicates: int
    rejected: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class LeasedRollout:
    uses: int
    lag: int
    blob: bytes
    prompt_id: str | None = None  # the prompt it answers, when posted under a work lease
    prompt: bytes | None = None  # that prompt's packed form (prompt_limits.py)


@dataclass(frozen=True, slots=True)
class Lease:
    batch_id: str
    policy_version: int
    expires_at_ms: int
    rollouts: list[LeasedRollout]
    token_floor: int | None  # under stale_tokens 'mask': tokens below it are handed out masked
    kl_coef: float | None  # the adaptive KL penalty's β at hand-out; None when off


@dataclass(frozen=True, slots=True)
class BatchMember:
    rollout_id: str
    policy_version: int
    tokens: int
    blob: bytes | None  # only when asked for


@dataclass(frozen=True, slots=True)
class BatchView:
    """A batch as the ack needs it before the ack script runs: leased, or acked already (a
    batch that was nacked or expired is refused with a StoreError)."""

    config: RunConfig  # the run's
    state: Literal["leased", "acked"]
    policy_version: int
    size: int
    answer: AckAnswer | None  # when acked
    members: list[BatchMember]  # while leased, when asked for
    token_floor: int | None = None  # as the lease fixed it (Lease.token_floor)
    measured: bytes | None = None  # the logprobs measure.lua kept, when asked for and any


@dataclass(frozen=True, slots=True)
class WorkItem:
    prompt_id: str
    pass_: int
    attempt: int
    blob: bytes
    partials: list[bytes] = field(default_factory=list)  # packed partial rollouts to continue

    @property
    def group_id(self) -> str:
        """The group a generator posts this attempt's rollouts under (ingest.lua parses it)."""
        return f"{self.prompt_id}#{self.pass_}.{self.attempt}"


@dataclass(frozen=True, slots=True)
class WorkLease:
    lease_id: str
    policy_version: int
    expires_at_ms: int
    items: list[WorkItem]


@dataclass(frozen=True, slots=True)
class SweepOutcome:
    more: bool  # work was left for another call
    retired: dict[str, int]  # rollouts retired, by reason

    @property
    def total(self) -> int:
        return sum(self.retired.values())


def _counts(rows: Sequence[Any]) -> dict[str, int]:
    """A retired_counts() reply value: {reason: rollouts}."""
    return {text(reason): int(n) for reason, n in rows}
