"""How a payload is declared: the ``wire(...)`` field of each attribute (its kind, key, whether it
may be absent, its line in the docs), the frozen-dataclass decorator of payload classes, and the
rules every decoded value follows (texts the ledger can hold, stream ids)."""

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
