"""Where the items of a document's one big list lie, for a parse one item at a time
(``app.api._codec.pack_items``): a document is an object (JSON) or map (msgpack) holding the list
under its key once, beside any other fields (``{"prompts": [...], "epochs": 2}``).

:func:`listing` finds the list and its items and hands back the number of items, an iterator
validating them one by one, and the document's other fields, to be validated with the list
replaced (:class:`Listing`). Anything it does not read as such a document is left to the
whole-document parse, which names the error as it always has: :func:`listing` answers None, or
the iteration raises :class:`Whole` when it meets an item that is not well-formed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack
import numpy as np
import orjson
import pydantic_core
from pydantic import BaseModel, ValidationError

from app.api._outline import msgpack_limits
from app.errors import BrokerError

I = TypeVar("I", bound=BaseModel)  # noqa: E741
W = TypeVar("W", bound=BaseModel)

Body = bytes | bytearray


class Whole(Exception):
    """The whole-document parse answers this body: an item is not well-formed JSON or msgpack,
    or the document's other fields are not (the parse names the error with its position)."""


class Invalid:
    """The validation errors of one item, located in the whole document."""

    __slots__ = ("errors",)

    def __init__(self, exc: ValidationError, field: str, index: int) -> None:
        errors = exc.errors(include_input=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise Whole
        self.errors = [{**e, "loc": (field, index, *e["loc"])} for e in errors]


@dataclass
class Listing(Generic[I, W]):
    count: int
    """The items of the list."""
    items: Iterator[I | Invalid]
    """Each item validated, up to the first invalid one (an :class:`Invalid`, the last yielded:
    the items after it are only read, as the whole parse reads them before it validates)."""
    rest: Callable[[list[Any]], W]
    """The document validated with its list replaced by the one given (``[]``)."""


def listing(
    body: Body,
    fmt: str | None,
    field: str,
    items: tuple[type[I], type[I]],
    whole: tuple[type[W], type[W]],
    widest: int,
) -> Listing[I, W] | None:
    """The list ``field`` of the document ``body`` (``fmt``: "json" or "msgpack"), read with
    ``items`` (the model of one item in each format) and ``whole`` (the document's); None when
    the body is not such a document."""
    if fmt == "msgpack":
        return _msgpack_listing(body, field, items[1], whole[1], widest)
    spans = json_spans(body, field) if fmt == "json" else None
    if spans is None:
        return None
    start, end, item_spans = spans
    head, tail, model = bytes(body[:start]), bytes(body[end:]), whole[0]
    return Listing(
        len(item_spans),
        _json_items(body, item_spans, field, items[0]),
        lambda replaced: model.model_validate_json(head + orjson.dumps(replaced) + tail),
    )


# JSON: where each item of the list lies, found from the positions of the characters that
# shape a document (quotes, backslashes, brackets, braces): numpy finds them a window at a
# time, and Python walks those few (some tens an item) rather than every byte. Each item is
# then parsed by pydantic exactly as within the whole document.
_JSON_OPEN = re.compile(rb"[ \t\n\r]*\{")
_JSON_BLANK = re.compile(rb"[ \t\n\r]*")
_JSON_COLON = re.compile(rb"[ \t\n\r]*:[ \t\n\r]*")
_JSON_COMMA = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")
_QUOTE, _BACKSLASH, _OPEN_ITEM = (ord(c) for c in '"\\{')
_CLOSE_LIST, _CLOSE_OBJECT = (ord(c) for c in "]}")
_WINDOW = 1 << 20
# Shaping characters per MiB of body beyond which walking them would cost more than it saves
# (metadata of many small strings or lists): such a body takes the whole-document parse.
_MAX_SHAPING = 1 << 16


def _shaping(body: Body, start: int) -> list[int] | None:
    """The positions of every quote, backslash, bracket and brace from ``start`` on, or None
    when there are too many to walk."""
    found: list[int] = []
    limit = _MAX_SHAPING * (1 + len(body) // _WINDOW)
    for at in range(start, len(body), _WINDOW):
        a = np.frombuffer(body, np.uint8, min(_WINDOW, len(body) - at), at)
        folded = a | 0x20  # '[' and '{', ']' and '}' differ only in that bit
        hits = np.flatnonzero((folded == 0x7B) | (folded == 0x7D) | (a == 0x22) | (a == 0x5C))
        if len(found) + hits.size > limit:
            return None
        found.extend((hits + at).tolist())
    return found


def json_spans(body: Body, field: str) -> tuple[int, int, list[tuple[int, int]]] | None:
    """Where the top-level object's list ``field`` starts and ends, and the (start, end) of
    each of its items; None unless the body is an object that holds the key ``field`` once, its
    value a list of objects, with its strings terminated and its brackets balanced. The other
    fields are left to the parse of the rest of the document."""
    top = _JSON_OPEN.match(body)
    shaping = None if top is None else _shaping(body, top.end())
    if top is None or shaping is None:
        return None
    spans: list[tuple[int, int]] = []
    at_list = end_list = -1  # the list's '[', and the end of its ']'
    last = start = opened = 0  # where the text between items starts; the item's '{'; the '"'
    depth = 1  # 1: in the top-level object, 2: in the list, 3: in an item
    in_list = in_string = False
    escaped = -1  # the position a backslash escapes
    for at in shaping:
        c = body[at]
        if in_string:
            if at == escaped:
                continue
            if c == _BACKSLASH:
                escaped = at + 1
            elif c == _QUOTE:
                in_string = False
                if depth == 1 and _is_key(body, opened, at, field):
                    colon = _JSON_COLON.match(body, at + 1)
                    if at_list >= 0 or colon is None or body[colon.end() : colon.end() + 1] != b"[":
                        return None  # the key twice, or its value is no list
                    at_list = colon.end()
            continue
        if c == _QUOTE:
            in_string, opened = True, at
        elif c == _BACKSLASH:  # outside a string: not JSON
            return None
        elif c in b"{[":
            if in_list and depth == 2:  # an item starts: after '[' or a comma, an object
                between = _JSON_COMMA if spans else _JSON_BLANK
                if c != _OPEN_ITEM or not between.fullmatch(body, last, at):
                    return None
                start = at
            elif at == at_list:
                in_list, last = True, at + 1
            depth += 1
        else:
            depth -= 1
            if in_list and depth == 2:
                spans.append((start, at + 1))
                last = at + 1
            elif in_list and depth == 1:  # the list closes
                if c != _CLOSE_LIST or not _JSON_BLANK.fullmatch(body, last, at):
                    return None
                in_list, end_list = False, at + 1
            elif depth == 0:  # the document closes
                if c != _CLOSE_OBJECT or end_list < 0 or not _JSON_BLANK.fullmatch(body, at + 1):
                    return None
                return at_list, end_list, spans
    return None  # the document never closes


def _is_key(body: Body, opened: int, closed: int, field: str) -> bool:
    """Whether the string from ``opened`` to ``closed`` (its quotes) is the key ``field``."""
    if _JSON_COLON.match(body, closed + 1) is None:
        return False  # a value, not a key
    try:
        key: str = json.loads(body[opened : closed + 1])
    except ValueError:
        return False  # the parse names it
    return key == field


def _json_items(
    body: Body, spans: list[tuple[int, int]], field: str, model: type[I]
) -> Iterator[I | Invalid]:
    for i, (start, end) in enumerate(spans):
        try:
            yield model.model_validate_json(body[start:end])
        except ValidationError as exc:
            invalid = Invalid(exc, field, i)
            for after, until in spans[i + 1 :]:
                try:
                    pydantic_core.from_json(body[after:until])
                except ValueError:
                    raise Whole from None
            yield invalid
            return


# msgpack: a streaming unpacker reads the document's map, skipping the list's items, then
# another reads one item at a time, through a reader that copies one slice of the body at a time.
_READ_SIZE = 1 << 20


class _Reader:
    def __init__(self, data: Body, start: int = 0) -> None:
        self._view = memoryview(data)
        self._pos = start

    def read(self, n: int) -> bytes:
        chunk = self._view[self._pos : self._pos + n].tobytes()
        self._pos += len(chunk)
        return chunk


def _msgpack_listing(
    body: Body, field: str, item: type[I], model: type[W], widest: int
) -> Listing[I, W] | None:
    limits = msgpack_limits(len(body), widest)  # one count of containers for both readers
    sizes = dict(read_size=_READ_SIZE, max_buffer_size=max(len(body), 2 * _READ_SIZE))
    reader = msgpack.Unpacker(_Reader(body), **limits, **sizes)
    rest: dict[Any, Any] = {}
    start = end = count = -1
    try:
        for _ in range(reader.read_map_header()):
            key = reader.unpack()
            if key != field:
                rest[key] = reader.unpack()
                continue
            if count >= 0:
                return None  # the key twice
            count = reader.read_array_header()
            start = reader.tell()
            for _ in range(count):
                reader.skip()
            end, rest[key] = reader.tell(), []
    except BrokerError:
        raise
    except Exception:  # not a map, or malformed: the whole parse says what it is
        return None
    if count < 0 or reader.tell() != len(body):
        return None
    items = msgpack.Unpacker(_Reader(body, start), **limits, **sizes)
    return Listing(
        count,
        _msgpack_items(items, count, end - start, field, item),
        lambda replaced: model.model_validate({**rest, field: replaced}),
    )


def _msgpack_items(
    unpacker: msgpack.Unpacker, count: int, size: int, field: str, model: type[I]
) -> Iterator[I | Invalid]:
    invalid: Invalid | None = None
    for i in range(count):
        try:
            doc = unpacker.unpack()
        except BrokerError:
            raise
        except Exception:
            raise Whole from None
        if invalid is not None:
            continue  # only read, as the whole parse does before it validates
        try:
            yield model.model_validate(doc)
        except ValidationError as exc:
            invalid = Invalid(exc, field, i)
    if unpacker.tell() != size:
        raise Whole
    if invalid is not None:
        yield invalid
