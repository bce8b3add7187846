"""Decoding of accounting stream entries (docs/events.md) into typed, validated events.

Decoding is strict about meaning and lenient about encoding: Redis's Lua msgpack encoder writes
whole floats as integers, drops trailing nils from arrays and may turn an array with a hole into
a map keyed 1..n, so all of those are accepted. Anything that cannot be applied safely (a wrong
type, a non-finite float, an integer outside int64) raises :class:`EventError`, which never
succeeds on a retry and so leads the entry to the dead-letter stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import total_ordering
from typing import Any, TypeAlias

import msgpack

__all__ = [
    "EVENT_TYPES",
    "Accepted",
    "AcceptedItem",
    "AckStats",
    "AckSums",
    "Acked",
    "AckedItem",
    "Duplicate",
    "Event",
    "EventError",
    "Leased",
    "LeasedItem",
    "Payload",
    "Rejected",
    "RejectedItem",
    "Retired",
    "RetiredItem",
    "Returned",
    "ReturnedItem",
    "RunChanged",
    "StreamId",
    "decode_entry",
]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_MAX_TEXT = 1024


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


# --- payload types -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunChanged:
    change: str
    config: dict[str, Any]
    policy_version: int
    status: str
    created_at_ms: int


@dataclass(frozen=True, slots=True)
class AcceptedItem:
    rollout_id: str
    unit_id: str
    policy_version: int
    tokens: int
    new_unit: bool


@dataclass(frozen=True, slots=True)
class Accepted:
    items: tuple[AcceptedItem, ...]


@dataclass(frozen=True, slots=True)
class Duplicate:
    n: int


@dataclass(frozen=True, slots=True)
class RejectedItem:
    rollout_id: str
    reason: str
    policy_version: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Rejected:
    items: tuple[RejectedItem, ...]


@dataclass(frozen=True, slots=True)
class LeasedItem:
    rollout_id: str
    policy_version: int
    tokens: int
    lag: int
    uses_before: int


@dataclass(frozen=True, slots=True)
class Leased:
    batch_id: str
    trainer_id: str | None
    policy_version: int
    expires_at_ms: int
    items: tuple[LeasedItem, ...]


@dataclass(frozen=True, slots=True)
class AckedItem:
    rollout_id: str
    policy_version: int
    tokens: int
    kl: float | None


@dataclass(frozen=True, slots=True)
class AckStats:
    kl_mean: float | None = None
    kl_max: float | None = None
    is_ratio_mean: float | None = None
    clip_fraction: float | None = None
    ess_fraction: float | None = None


@dataclass(frozen=True, slots=True)
class AckSums:
    kl_tokens: int = 0
    kl_sum: float = 0.0
    ratio_tokens: int = 0
    ratio_sum: float = 0.0
    clipped: int = 0


@dataclass(frozen=True, slots=True)
class Acked:
    batch_id: str
    step: int | None
    policy_version: int
    items: tuple[AckedItem, ...]
    stats: AckStats
    sums: AckSums


@dataclass(frozen=True, slots=True)
class ReturnedItem:
    rollout_id: str
    policy_version: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Returned:
    """``nacked`` or ``expired``: leased rollouts back in the buffer without a use."""

    batch_id: str
    items: tuple[ReturnedItem, ...]


@dataclass(frozen=True, slots=True)
class RetiredItem:
    rollout_id: str
    policy_version: int
    tokens: int
    uses: int


@dataclass(frozen=True, slots=True)
class Retired:
    reason: str
    items: tuple[RetiredItem, ...]


Payload: TypeAlias = (
    RunChanged | Accepted | Duplicate | Rejected | Leased | Acked | Returned | Retired
)


@dataclass(frozen=True, slots=True)
class Event:
    """One decoded stream entry of one run."""

    run_id: str
    stream_id: StreamId
    type: str
    t_ms: int
    body: Payload


# --- field readers ---------------------------------------------------------------------------


def _text(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise EventError(f"{what}: not UTF-8") from None
    if not isinstance(value, str):
        raise EventError(f"{what}: expected a string, got {type(value).__name__}")
    if "\x00" in value or len(value) > _MAX_TEXT:
        raise EventError(f"{what}: NUL byte or longer than {_MAX_TEXT} characters")
    return value


def _opt_text(value: Any, what: str) -> str | None:
    return None if value is None else _text(value, what)


def _int(value: Any, what: str, *, minimum: int = _INT64_MIN) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventError(f"{what}: expected an integer, got {type(value).__name__}")
    if not minimum <= value <= _INT64_MAX:
        raise EventError(f"{what}: {value} out of range")
    return value


def _opt_int(value: Any, what: str, *, minimum: int = _INT64_MIN) -> int | None:
    return None if value is None else _int(value, what, minimum=minimum)


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EventError(f"{what}: expected a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise EventError(f"{what}: not finite")
    return result


def _opt_float(value: Any, what: str) -> float | None:
    return None if value is None else _float(value, what)


def _flag(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if value in (0, 1):
        return bool(value)
    raise EventError(f"{what}: expected 0 or 1")


def _map(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise EventError(f"{what}: expected a map with string keys")
    return value


def _opt_map(value: Any, what: str) -> dict[str, Any]:
    return {} if value is None else _map(value, what)


def _json(value: Any, what: str, depth: int = 0) -> Any:
    """A value that JSONB can store as it is (the run config is kept verbatim)."""
    if depth > 32:
        raise EventError(f"{what}: nested too deeply")
    if value is None or isinstance(value, bool | int | str):
        if isinstance(value, int) and not isinstance(value, bool):
            return _int(value, what)
        return _text(value, what) if isinstance(value, str) else value
    if isinstance(value, float):
        return _float(value, what)
    if isinstance(value, bytes):
        return _text(value, what)
    if isinstance(value, list):
        return [_json(v, what, depth + 1) for v in value]
    if isinstance(value, dict):
        return {_text(k, what): _json(v, what, depth + 1) for k, v in value.items()}
    raise EventError(f"{what}: {type(value).__name__} is not JSON")


def _array(value: Any, what: str) -> list[Any]:
    """A list, or the map a Lua encoder writes for an array with holes (keys 1..n)."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict) and all(
        isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 4096 for k in value
    ):
        size = max(value, default=0)
        return [value.get(i) for i in range(1, size + 1)]
    if isinstance(value, dict) and not value:
        return []
    raise EventError(f"{what}: expected an array")


def _items(payload: Mapping[str, Any], arity: int, required: int) -> list[list[Any]]:
    """Fixed-position item arrays, padded with nil where a trailing optional was dropped."""
    rows = []
    for i, raw in enumerate(_array(payload.get("items"), "items")):
        row = _array(raw, f"items[{i}]")
        if not required <= len(row) <= arity:
            raise EventError(f"items[{i}]: expected {arity} fields, got {len(row)}")
        rows.append(row + [None] * (arity - len(row)))
    return rows


# --- per-type decoders -----------------------------------------------------------------------


def _run(d: Mapping[str, Any]) -> RunChanged:
    return RunChanged(
        change=_text(d.get("change"), "change"),
        config=_json(_opt_map(d.get("config"), "config"), "config"),
        policy_version=_int(d.get("policy_version"), "policy_version"),
        status=_text(d.get("status"), "status"),
        created_at_ms=_int(d.get("created_at"), "created_at", minimum=0),
    )


def _accepted(d: Mapping[str, Any]) -> Accepted:
    return Accepted(
        tuple(
            AcceptedItem(
                rollout_id=_text(r[0], "rollout_id"),
                unit_id=_text(r[1], "unit_id"),
                policy_version=_int(r[2], "policy_version"),
                tokens=_int(r[3], "tokens", minimum=0),
                new_unit=_flag(r[4], "new_unit"),
            )
            for r in _items(d, 5, 5)
        )
    )


def _duplicate(d: Mapping[str, Any]) -> Duplicate:
    n = d.get("n")
    if n is None:
        n = len(_array(d.get("ids"), "ids"))
    return Duplicate(_int(n, "n", minimum=0))


def _rejected(d: Mapping[str, Any]) -> Rejected:
    return Rejected(
        tuple(
            RejectedItem(
                rollout_id=_text(r[0], "rollout_id"),
                reason=_text(r[1], "reason"),
                policy_version=_int(r[2], "policy_version"),
                tokens=_int(r[3], "tokens", minimum=0),
            )
            for r in _items(d, 4, 4)
        )
    )


def _leased(d: Mapping[str, Any]) -> Leased:
    return Leased(
        batch_id=_text(d.get("batch_id"), "batch_id"),
        trainer_id=_opt_text(d.get("trainer_id"), "trainer_id"),
        policy_version=_int(d.get("policy_version"), "policy_version"),
        expires_at_ms=_int(d.get("expires_at"), "expires_at", minimum=0),
        items=tuple(
            LeasedItem(
                rollout_id=_text(r[0], "rollout_id"),
                policy_version=_int(r[1], "policy_version"),
                tokens=_int(r[2], "tokens", minimum=0),
                lag=_int(r[3], "lag"),
                uses_before=_int(r[4], "uses_before", minimum=0),
            )
            for r in _items(d, 5, 5)
        ),
    )


def _acked(d: Mapping[str, Any]) -> Acked:
    stats = _opt_map(d.get("stats"), "stats")
    sums = _opt_map(d.get("sums"), "sums")
    return Acked(
        batch_id=_text(d.get("batch_id"), "batch_id"),
        step=_opt_int(d.get("step"), "step"),
        policy_version=_int(d.get("policy_version"), "policy_version"),
        items=tuple(
            AckedItem(
                rollout_id=_text(r[0], "rollout_id"),
                policy_version=_int(r[1], "policy_version"),
                tokens=_int(r[2], "tokens", minimum=0),
                kl=_opt_float(r[3], "kl"),
            )
            for r in _items(d, 4, 3)
        ),
        stats=AckStats(
            kl_mean=_opt_float(stats.get("kl_mean"), "stats.kl_mean"),
            kl_max=_opt_float(stats.get("kl_max"), "stats.kl_max"),
            is_ratio_mean=_opt_float(stats.get("is_ratio_mean"), "stats.is_ratio_mean"),
            clip_fraction=_opt_float(stats.get("clip_fraction"), "stats.clip_fraction"),
            ess_fraction=_opt_float(stats.get("ess_fraction"), "stats.ess_fraction"),
        ),
        sums=AckSums(
            kl_tokens=_int(sums.get("kl_tokens", 0), "sums.kl_tokens", minimum=0),
            kl_sum=_float(sums.get("kl_sum", 0.0), "sums.kl_sum"),
            ratio_tokens=_int(sums.get("ratio_tokens", 0), "sums.ratio_tokens", minimum=0),
            ratio_sum=_float(sums.get("ratio_sum", 0.0), "sums.ratio_sum"),
            clipped=_int(sums.get("clipped", 0), "sums.clipped", minimum=0),
        ),
    )


def _returned(d: Mapping[str, Any]) -> Returned:
    return Returned(
        batch_id=_text(d.get("batch_id"), "batch_id"),
        items=tuple(
            ReturnedItem(
                rollout_id=_text(r[0], "rollout_id"),
                policy_version=_int(r[1], "policy_version"),
                tokens=_int(r[2], "tokens", minimum=0),
            )
            for r in _items(d, 3, 3)
        ),
    )


def _retired(d: Mapping[str, Any]) -> Retired:
    return Retired(
        reason=_text(d.get("reason"), "reason"),
        items=tuple(
            RetiredItem(
                rollout_id=_text(r[0], "rollout_id"),
                policy_version=_int(r[1], "policy_version"),
                tokens=_int(r[2], "tokens", minimum=0),
                uses=_int(r[3], "uses", minimum=0),
            )
            for r in _items(d, 4, 4)
        ),
    )


_DECODERS: dict[str, Callable[[Mapping[str, Any]], Payload]] = {
    "run": _run,
    "accepted": _accepted,
    "duplicate": _duplicate,
    "rejected": _rejected,
    "leased": _leased,
    "acked": _acked,
    "nacked": _returned,
    "expired": _returned,
    "retired": _retired,
}

EVENT_TYPES = frozenset(_DECODERS)


def decode_entry(run_id: str, entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> Event:
    """Decode one stream entry (fields ``e`` and ``d``) of run ``run_id``."""
    stream_id = StreamId.parse(entry_id)
    raw_type = fields.get(b"e")
    raw_payload = fields.get(b"d")
    if raw_type is None or raw_payload is None:
        raise EventError("entry lacks field 'e' or 'd'")
    event_type = _text(raw_type, "e")
    decoder = _DECODERS.get(event_type)
    if decoder is None:
        raise EventError(f"unknown event type {event_type!r}")
    try:
        payload = msgpack.unpackb(raw_payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise EventError(f"payload is not msgpack: {exc}") from None
    payload = _map(payload, "d")
    if event_type == "run" and _text(payload.get("run_id"), "run_id") != run_id:
        raise EventError("run event of another run")
    body = decoder(payload)
    return Event(
        run_id=run_id,
        stream_id=stream_id,
        type=event_type,
        t_ms=_int(payload.get("t"), "t", minimum=0),
        body=body,
    )
