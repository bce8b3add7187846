"""The declaration of the accounting events' payloads: one frozen dataclass per payload, item and
map, whose ``wire(...)`` fields say how each is written (see the package docstring)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import total_ordering
from typing import Any, Literal, TypeAlias, TypeVar, dataclass_transform

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
MAX_TEXT = 1024


def text_fault(value: str) -> str | None:
    """Why the ledger cannot hold ``value`` as a text (an id, a reason), or None when it can.

    This is the one rule: the decoder applies it to every text of an event, and the API applies
    it to every id it accepts (app/broker/config.py), so whatever a script is given to record,
    the drain can apply. A Postgres ``text`` holds no NUL and only UTF-8; the length bound keeps
    ledger rows and keys small.
    """
    if len(value) > MAX_TEXT:
        return f"longer than {MAX_TEXT} characters"
    if "\x00" in value:
        return "holds a NUL character, which the ledger cannot store"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "is not valid Unicode (a lone surrogate)"
    return None


class EventError(ValueError):
    """A stream entry that does not follow the event contract; retrying cannot fix it."""


@total_ordering
@dataclass(frozen=True, slots=True)
class StreamId:
    """A Redis stream entry id, ``<ms>-<seq>``, ordered the way Redis orders it."""

    ms: int
    seq: int

    @classmethod
    def parse(cls, raw: bytes | str) -> StreamId:
        text = raw.decode("ascii") if isinstance(raw, bytes) else raw
        ms, sep, seq = text.partition("-")
        try:
            if not sep:
                raise ValueError(text)
            return cls(int(ms), int(seq))
        except ValueError:
            raise EventError(f"not a stream id: {text!r}") from None

    def next(self) -> StreamId:
        """The smallest id greater than this one (``XTRIM MINID`` keeps ids >= its argument)."""
        if self.seq >= 2**64 - 1:
            return StreamId(self.ms + 1, 0)
        return StreamId(self.ms, self.seq + 1)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, StreamId):
            return NotImplemented
        return (self.ms, self.seq) < (other.ms, other.seq)

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"


def lag_of(batch_version: int, rollout_version: int) -> int:
    """A rollout's lag in a batch: the batch's (trainer's) policy version minus the rollout's.

    lease.lua writes it into each ``leased`` item (and into the lease's reply); an ``acked``
    item does not carry it, so the fold derives a sample's lag here from the ``acked`` event's
    own ``policy_version``. It cannot borrow it from the batch's ``leased`` event, which may be
    applied in another transaction (folding is order-free). tests/accounting/test_event_schema.py
    checks that every ``leased`` item the scripts write carries exactly this value.
    """
    return batch_version - rollout_version


# --- the declaration -------------------------------------------------------------------------

Kind: TypeAlias = Literal["text", "int", "float", "flag", "map", "texts", "items", "struct"]

_REQUIRED: Any = dataclasses.MISSING


@dataclass(frozen=True, slots=True)
class Wire:
    """How one attribute of a payload class is written in the event."""

    kind: Kind
    key: str | None  # the key in the payload map; None: the attribute's name
    # May be absent (nil): then it decodes to the attribute's default, or None. A "map" or
    # "struct" that is absent always reads as empty.
    optional: bool
    minimum: int
    of: type | None  # "items": the item class; "struct": the map's class
    note: str  # for the docs' table


def wire(
    kind: Kind,
    *,
    key: str | None = None,
    optional: bool = False,
    minimum: int = _INT64_MIN,
    of: type | None = None,
    note: str = "",
    default: Any = _REQUIRED,
) -> Any:
    """A dataclass field that is part of an event payload (see :class:`Wire`)."""
    metadata = {"wire": Wire(kind, key, optional, minimum, of, note)}
    if default is _REQUIRED:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, field_specifiers=(wire,))
def _wire_class(cls: type[_T]) -> type[_T]:
    """A payload class (or an item or map of one): a frozen dataclass of ``wire`` fields."""
    return dataclass(frozen=True, slots=True)(cls)


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


@_wire_class
class Accepted:
    items: tuple[AcceptedItem, ...] = wire("items", of=AcceptedItem)


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


@_wire_class
class RegisteredItem:
    prompt_id: str = wire("text")
    passes: int = wire("int", minimum=1, note="`epochs`: passes 1..passes are queued")


@_wire_class
class Registered:
    items: tuple[RegisteredItem, ...] = wire("items", of=RegisteredItem)


@_wire_class
class WorkItem:
    prompt_id: str = wire("text")
    pass_: int = wire("int", key="pass", minimum=1)
    attempt: int = wire("int", minimum=1)


@_wire_class
class WorkLeased:
    lease_id: str = wire("text")
    generator_id: str | None = wire("text", optional=True, note="str or nil")
    policy_version: int = wire("int", note="the run's V when handed out")
    expires_at_ms: int = wire("int", key="expires_at", minimum=0, note="ms")
    items: tuple[WorkItem, ...] = wire("items", of=WorkItem)
    wait_ms: int = wire(
        "int", optional=True, minimum=0, default=0, note="ms the generator's request waited"
    )


@_wire_class
class PassItem:
    prompt_id: str = wire("text")
    pass_: int = wire("int", key="pass", minimum=1)
    attempt: int = wire("int", minimum=1, note="the attempt this state belongs to")
    state: str = wire("text", note="`queued`, `in_flight`, `done`, `failed`")
    tries: int = wire("int", minimum=0, note="attempts that retired unused or expired")


@_wire_class
class PassesChanged:
    cause: str = wire(
        "text",
        note="`returned`, `expired` (work lease), `rejected` (a rollout of its attempt was "
        "rejected `stale`, in `rejected`: the attempt ended), `retired` (its group retired: the "
        "reason is in `retired`), `acked` (first use), `rewound` (a rewind undid the batches "
        "that completed it: `in_flight` at a later attempt while its group is buffered, else "
        "`queued`; or it ended the pass's work lease, taken above `W`: `queued`; neither is a "
        "try)",
    )
    lease_id: str | None = wire("text", optional=True, note="the work lease, when one")
    items: tuple[PassItem, ...] = wire("items", of=PassItem)


@_wire_class
class PartialItem:
    rollout_id: str = wire("text")
    prompt_id: str = wire("text")
    pass_: int = wire("int", key="pass", minimum=1)
    policy_version: int = wire("int", note="the partial's (its oldest token's version)")
    tokens: int = wire("int", minimum=0, note="response tokens sampled so far")


@_wire_class
class PartialsChanged:
    change: str = wire(
        "text",
        note="`returned` (given back with its prompt, or brought back by an attempt that ended "
        "unfinished), `resumed` (handed out with a work lease), `dropped`",
    )
    reason: str | None = wire(
        "text",
        optional=True,
        note="`dropped`: `stale` / `kl_flush` (too stale when handed out), `unused` (its group "
        "completed without it), `failed` (its pass failed), `rewound` (a token sampled above "
        "the run's version when handed out, after a rewind)",
    )
    lease_id: str | None = wire("text", optional=True, note="the work lease, when one")
    items: tuple[PartialItem, ...] = wire("items", of=PartialItem)


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
