"""What a body holds, counted before it is parsed: how many items each list or object has, how
many lists and objects there are, how deep they nest. A parser builds a tree of every value
before any rule runs (pydantic's JSON parser as much as ``msgpack.unpackb``), so the rules on
these counts are what bound the cost of a body: a list of millions of items is refused by its
count alone, without a value of it ever becoming an object.

JSON is counted with numpy, a window of the body at a time: the quotes that open and close
strings (a backslash run of odd length escapes the next one), then outside the strings the
brackets, braces and commas, each at its level of nesting. msgpack is counted from its headers:
the top-level map's values are skipped without being decoded, and the parse that follows
refuses any list or map longer than the bound, and more lists and maps than the budget, as it
meets them.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack
import numpy as np

from app.errors import BrokerError, ValidationFailed

if TYPE_CHECKING:
    from app.settings import Settings

T = TypeVar("T")
Body = bytes | bytearray

MAX_DEPTH = 64
"""Nesting deeper than this is refused (metadata nests at most 16 levels, inside 3)."""

WIDEST = 1 << 19
"""The most items of a list or object in a body, for an app without settings (twice the
longest legitimate list: a rollout's or a prompt's tokens; see :func:`widest_list`)."""

SMALL_BODY_BYTES = 64 << 10
"""The size limit of a body that holds no list of any length (a run, a config patch, a policy
version, a work request, a token): a few hundred bytes each at most."""

Counts = dict[str, Callable[[int], None]]
"""Per top-level field whose value is a list or an object: the rule on its number of items
(raises the request's error), applied before any of them is parsed. Each is an upper bound with
no other effect: a rule that passes a count passes every smaller one (:func:`within_bounds`
relies on it)."""


def container_budget(size: int) -> int:
    """The most lists and objects a body of ``size`` bytes may hold: one per 8 bytes (the
    legitimate bodies have one per 15 bytes or more: a rollout, a prompt, an ack's logprobs of
    one token), at least 65,536. A parser builds each as an object of 50 to 100 bytes."""
    return max(1 << 16, size // 8)


_WINDOW = 1 << 18  # 256 KiB: the arrays of one window are a few megabytes
_KEY = re.compile(rb'"((?:[^"\\]|\\.){0,256})"[ \t\n\r]*:[ \t\n\r]*$')
_KEY_LOOKBACK = 600  # enough for a key of 256 characters, escaped, and its colon


@dataclass
class Outline:
    """The counts of a body, complete up to ``end`` (where the counting stopped: the body's end,
    or the first bracket that closes nothing)."""

    fields: dict[str, int] = field(default_factory=dict)
    """The items of each list or object value of the top-level object, by its key (the first
    of a repeated key; only the first few keys are named)."""
    widest: int = 0
    """The most items in any other list or object (the top-level one included)."""
    containers: int = 0
    deepest: int = 0


_NAMED = 16  # top-level keys whose values are counted by name

_OPEN, _CLOSE, _COMMA, _QUOTE, _BACKSLASH = 1, 2, 3, 4, 5
_CODE = np.zeros(256, np.uint8)  # each byte's kind: structure (outside strings), quote, backslash
_CODE[[ord("["), ord("{")]] = _OPEN
_CODE[[ord("]"), ord("}")]] = _CLOSE
_CODE[ord(",")] = _COMMA
_CODE[ord('"')] = _QUOTE
_CODE[ord("\\")] = _BACKSLASH
_KINDS = bytes(_CODE.tolist())  # the same as a bytes.translate table
_STEP = np.array([0, 1, -1, 0, 0, 0], np.int32)  # the change of depth at each kind


def json_outline(body: bytes | bytearray) -> Outline:
    """The counts of a JSON body (see :class:`Outline`), whatever its syntax: a parse names
    any syntax error afterwards, having built no more than was counted."""
    out = Outline()
    state = _State()
    for at in range(0, len(body), _WINDOW):
        # Each byte's kind (bytes.translate is a quicker table lookup than numpy's indexing).
        codes = np.frombuffer(body[at : at + _WINDOW].translate(_KINDS), np.uint8)
        if not state.window(body, codes, at, out):
            break
    state.close(out)
    return out


class _State:
    """What one window hands the next: inside a string or not, the backslashes just before, the
    depth, and the items so far of the list or object open at each level."""

    def __init__(self) -> None:
        self.in_string = False
        self.backslashes = 0
        self.depth = 0
        self.open_items = np.zeros(MAX_DEPTH + 2, np.int64)  # commas so far, by level
        self.open_named: dict[int, str | None] = {}  # level 2: the key of the open value

    def _strings(self, ev: np.ndarray, kind: np.ndarray, size: int) -> np.ndarray:
        """Of a window's events (positions ``ev`` of its quotes, backslashes and structure,
        ``kind`` of each), which are outside strings: a quote opens or closes one unless a
        backslash run of odd length is just before it. Only the events are looked at, never
        the bytes between them (``ev`` is never empty)."""
        bs = kind == _BACKSLASH
        quote = kind == _QUOTE
        if bs.any() or self.backslashes:
            # Runs of adjacent backslashes, each event's length of the run so far; a run at the
            # window's start continues the one the last window ended with.
            idx = np.arange(ev.size)
            prev_adjacent = np.zeros(ev.size, bool)
            prev_adjacent[1:] = bs[:-1] & (ev[1:] == ev[:-1] + 1)
            first = np.maximum.accumulate(np.where(bs & ~prev_adjacent, idx, 0))
            run = idx - first + 1
            run[bs & (ev[first] == 0)] += self.backslashes
            before = np.zeros(ev.size, np.int64)  # the backslashes just before each event
            before[1:] = np.where(prev_adjacent[1:], run[:-1], 0)
            if ev[0] == 0:
                before[0] = self.backslashes
            quote &= before % 2 == 0
            tail = bool(bs[-1]) and int(ev[-1]) == size - 1
            self.backslashes = int(run[-1]) if tail else 0
        if not (self.in_string or quote.any()):
            return kind <= _COMMA
        parity = np.cumsum(quote, dtype=np.int32)
        if self.in_string:
            parity += 1
        self.in_string = bool(parity[-1] & 1)
        outside: np.ndarray = ((parity & 1) == 0) & (kind <= _COMMA)
        return outside

    def window(self, body: bytes | bytearray, codes: np.ndarray, at: int, out: Outline) -> bool:
        """Count one window, given the kind of each of its bytes (``_KINDS``); False once the
        structure has ended or broken."""
        ev = np.flatnonzero(codes != 0)  # a boolean array's are found several times quicker
        if not ev.size:
            self.backslashes = 0
            return True
        kind = codes[ev]
        outside = self._strings(ev, kind, codes.size)
        ev, kind = ev[outside], kind[outside]
        if not ev.size:
            return True
        depth = self.depth + np.cumsum(_STEP[kind], dtype=np.int32)
        level = depth + (kind == _CLOSE)  # a close belongs to the level it ends
        broken = np.flatnonzero((level < 1) | (level > MAX_DEPTH + 1))
        if broken.size:
            cut = int(broken[0])
            out.deepest = max(out.deepest, int(level[cut]))
            ev, kind, level, depth = ev[:cut], kind[:cut], level[:cut], depth[:cut]
        if ev.size:
            out.containers += int(np.count_nonzero(kind == _OPEN))
            out.deepest = max(out.deepest, int(level.max()))
            self._levels(body, at, ev, kind, level, out)
        if broken.size:
            return False
        self.depth = int(depth[-1])
        return True

    def _levels(
        self,
        body: bytes | bytearray,
        at: int,
        ev: np.ndarray,
        kind: np.ndarray,
        level: np.ndarray,
        out: Outline,
    ) -> None:
        """Per level, the commas of each list or object, carried over from the last window for
        the one still open there."""
        for lvl in np.flatnonzero(np.bincount(level)).tolist():
            at_level = level == lvl
            k = kind[at_level]
            segment = np.cumsum(k == _OPEN)  # 0: the list or object open since an earlier window
            commas = np.bincount(segment[k == _COMMA], minlength=int(segment[-1]) + 1)
            commas[0] += self.open_items[lvl]
            opened = ev[at_level][k == _OPEN]
            closed = k == _CLOSE
            if lvl == 2:
                self._named(body, at, opened, commas, closed, out)
            else:
                out.widest = max(out.widest, int(commas.max()) + 1)
            still_open = not closed[-1]
            self.open_items[lvl] = commas[-1] if still_open else 0

    def _named(
        self,
        body: bytes | bytearray,
        at: int,
        opened: np.ndarray,
        commas: np.ndarray,
        closed: np.ndarray,
        out: Outline,
    ) -> None:
        """Level 2: the values of the top-level object, counted under their keys."""
        for i, items in enumerate(commas.tolist()):
            if i == 0:
                key = self.open_named.get(2)
            elif len(out.fields) < _NAMED:
                key = _key_before(body, at + int(opened[i - 1]))
            else:
                key = None
            if key is None or (key in out.fields and i > 0):
                out.widest = max(out.widest, items + 1)
            else:
                out.fields[key] = max(out.fields.get(key, 0), items + 1)
            if i == len(commas) - 1:
                self.open_named[2] = key if not closed[-1] else None

    def close(self, out: Outline) -> None:
        for lvl in range(1, MAX_DEPTH + 2):
            if self.open_items[lvl] and lvl != 2:
                out.widest = max(out.widest, int(self.open_items[lvl]) + 1)


def _key_before(body: bytes | bytearray, pos: int) -> str | None:
    m = _KEY.search(bytes(body[max(0, pos - _KEY_LOOKBACK) : pos]))
    if m is None:
        return None
    try:
        key: str = json.loads(b'"' + m[1] + b'"')
    except ValueError:
        return None
    return key


def msgpack_fields(body: bytes | bytearray, stop_above: int) -> dict[str, int]:
    """The items of each list or map value of a msgpack body's top-level map, by key, read from
    their headers (every value is skipped, not decoded; the reading stops at a value of more
    than ``stop_above`` items); empty when the body is not a map."""
    unpacker = msgpack.Unpacker(io.BytesIO(body), raw=False, max_buffer_size=max(len(body), 1))
    found: dict[str, int] = {}
    try:
        n = unpacker.read_map_header()
        for _ in range(n):
            key = unpacker.unpack()
            head = body[unpacker.tell()] if unpacker.tell() < len(body) else 0
            if isinstance(key, str) and _is_list_head(head):
                items = unpacker.read_array_header()
                found.setdefault(key, items)
                if items > stop_above:
                    break
                _skip(unpacker, items)
            elif isinstance(key, str) and _is_map_head(head):
                items = unpacker.read_map_header()
                found.setdefault(key, items)
                if items > stop_above:
                    break
                _skip(unpacker, 2 * items)
            else:
                unpacker.skip()
    except Exception:  # not a map, or malformed: the parse says which
        pass
    return found


def _skip(unpacker: msgpack.Unpacker, n: int) -> None:
    for _ in range(n):
        unpacker.skip()


def _is_list_head(b: int) -> bool:
    return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)


def _is_map_head(b: int) -> bool:
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


# -- the rules on the counts ---------------------------------------------------------------------


def widest_list(settings: Settings) -> int:
    """The most items a list or object of a body may hold: twice the longest a legitimate
    request needs (a rollout's or a prompt's tokens, a batch's rollouts, a request's rollouts
    or prompts), so that a list a little beyond its own limit is told so by that limit's rule,
    which names the rollout or prompt."""
    return 2 * max(
        settings.max_tokens_per_rollout,
        settings.max_tokens_per_prompt,
        settings.max_batch_size,
        settings.max_rollouts_per_request,
        settings.max_prompts_per_request,
    )


def _count(body: Body, char: str) -> int:
    """How often ``char`` occurs in the body: numpy counts a byte several times quicker than
    bytes.count, a window at a time, so that no array is as big as a big body."""
    codes = np.frombuffer(body, np.uint8)
    byte = ord(char)
    return sum(
        int(np.count_nonzero(codes[at : at + _WINDOW] == byte))
        for at in range(0, codes.size, _WINDOW)
    )


def within_bounds(body: Body, rules: Counts, widest: int) -> bool:
    """Whether a JSON body meets every rule of :func:`check_counts` by three byte counts alone,
    without its outline: no list or object holds more items than the body has commas, plus one,
    and none nests deeper, nor are there more of them, than the body has ``[`` and ``{`` (those
    in strings are counted too, so each count bounds from above). True only when those bounds
    already meet the rules: a one-rollout ingest's body does, and its outline would cost about a
    tenth of its request (benchmarks/README.md, "Libraries on the hot paths")."""
    # container_budget() is never below 65,536, far above MAX_DEPTH. A body of many lists (an
    # ingest of more than one rollout, an ack) is told by its first count.
    lists = _count(body, "[")
    if lists > MAX_DEPTH or lists + _count(body, "{") > MAX_DEPTH:
        return False
    items = _count(body, ",") + 1
    if items > widest:
        return False
    try:
        for rule in rules.values():
            rule(items)
    except BrokerError:
        return False
    return True


def check_counts(
    body: Body, fmt: str | None, counts: Counts | None = None, widest: int = WIDEST
) -> None:
    """The rules on what a body holds, counted before it is parsed (app/api/_outline.py):
    ``counts``' rules on the items of top-level fields, then at most ``widest`` items in any
    other list or object, nesting at most :data:`MAX_DEPTH` deep, and at most
    :func:`container_budget` lists and objects. A msgpack body's lists and maps beyond the
    top-level fields are bounded as it is parsed (:func:`unpack`)."""
    rules = counts or {}
    if fmt == "msgpack":
        _check_fields(msgpack_fields(body, widest), rules, widest)
    elif fmt == "json" and not within_bounds(body, rules, widest):
        out = json_outline(body)
        _check_fields(out.fields, rules, widest)
        _check_widest(out.widest, widest)
        if out.deepest > MAX_DEPTH:
            raise ValidationFailed(f"the body nests lists and objects deeper than {MAX_DEPTH}")
        if out.containers > container_budget(len(body)):
            _too_many_containers(len(body))


def _check_fields(found: dict[str, int], rules: Counts, widest: int) -> None:
    for key, n in found.items():
        rule = rules.get(key)
        if rule is None:
            _check_widest(n, widest)
        else:
            rule(n)


def _check_widest(n: int, widest: int) -> None:
    if n > widest:
        raise ValidationFailed(f"a list or object in the body holds {n} items, at most {widest}")


def _too_many_containers(size: int) -> None:
    raise ValidationFailed(
        f"the body holds more than {container_budget(size)} lists and objects, the most a "
        f"body of {size} bytes may hold"
    )


def _containers(size: int) -> Callable[[T], T]:
    """A hook for msgpack's lists and maps that counts them, refusing past the budget.

    A generator's ``send``: resuming its frame costs about half what a Python function call
    does, and a body of multi-turn rollouts makes tens of thousands of small lists."""

    def count() -> Generator[Any, Any, None]:
        obj = None
        for _ in range(container_budget(size) + 1):
            obj = yield obj  # the first yield primes it: ``budget`` containers pass
        _too_many_containers(size)

    counter = count()
    next(counter)
    return counter.send


def msgpack_limits(size: int, widest: int) -> dict[str, Any]:
    hook = _containers(size)
    return dict(
        raw=False,
        strict_map_key=True,
        max_array_len=widest,
        max_map_len=widest,
        list_hook=hook,
        object_hook=hook,
    )


def unpack(body: Body, widest: int) -> Any:
    try:
        return msgpack.unpackb(body, **msgpack_limits(len(body), widest))
    except BrokerError:
        raise
    except ValueError as exc:
        if "exceeds max_" in str(exc):
            raise ValidationFailed(
                f"a list or object in the body holds more than {widest} items, at most {widest}"
            ) from None
        raise _not_msgpack(exc) from None
    except Exception as exc:
        raise _not_msgpack(exc) from None


def _not_msgpack(exc: Exception) -> ValidationFailed:
    return ValidationFailed(
        f"body is not valid msgpack ({type(exc).__name__}: {exc or 'truncated'})"
    )
