"""The rules of query parameters that FastAPI's own validation leaves open, one for every route
(an app-wide dependency, :func:`query_rules`; the API description says them, :func:`describe`):

- an integer is written in digits, with an optional minus sign: ``2``, never ``2.0``, ``+2`` or
  `` 2`` (FastAPI reads those as 2). Request bodies hold the same rule: their models are strict,
  so a JSON or msgpack number with a fraction or an exponent is not an integer, whole or not;
- a ``cursor`` is never empty: the first page is asked for without one, and an empty cursor
  (a client that sent back a null ``next_cursor`` as text) would start over from it.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Iterator
from typing import Any, Final, Union, get_args, get_origin

from fastapi import Request

from app.errors import ValidationFailed

INTEGER_RULE: Final = (
    "An integer is written in digits, with an optional minus sign (2, not 2.0): a number with "
    "a fraction or an exponent is refused (422), whole or not"
)
CURSOR_RULE: Final = (
    "A previous page's next_cursor; never empty (omit it for the first page): an empty cursor "
    "is refused (422)"
)
CURSOR: Final = "cursor"
_INTEGER: Final = re.compile(r"-?[0-9]+")


def _is_integer(annotation: Any) -> bool:
    if annotation is int:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return any(a is int for a in get_args(annotation))
    return False


def _query_params(dependant: Any) -> Iterator[Any]:
    yield from dependant.query_params
    for sub in dependant.dependencies:
        yield from _query_params(sub)


def _rules_of(route: Any) -> tuple[tuple[str, ...], bool]:
    """The integer query parameters of ``route`` and whether it takes a ``cursor``."""
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return (), False
    params = list(_query_params(dependant))
    integers = tuple(p.alias for p in params if _is_integer(p.field_info.annotation))
    return integers, any(p.alias == CURSOR for p in params)


async def query_rules(request: Request) -> None:
    """Refuse (422) a query that breaks :data:`INTEGER_RULE` or :data:`CURSOR_RULE`."""
    if not request.url.query:
        return
    integers, cursor = _rules_of(request.scope.get("route"))
    query = request.query_params
    for name in integers:
        for value in query.getlist(name):
            if not _INTEGER.fullmatch(value):
                raise ValidationFailed(f"query.{name}: not an integer. {INTEGER_RULE}")
    if cursor and "" in query.getlist(CURSOR):
        raise ValidationFailed(f"query.{CURSOR}: empty. {CURSOR_RULE}")


SUMMARY: Final = (
    f"Integers: {INTEGER_RULE}, in request bodies (JSON and msgpack) as in query parameters. "
    "Cursors: never empty; the first page is asked for without one (an empty cursor is refused, "
    "422)."
)


def describe(doc: dict[str, Any], operations: Iterable[tuple[str, str, dict[str, Any]]]) -> None:
    """Say the rules in the API description: in its summary, on every integer query parameter
    and on every cursor (``minLength`` 1)."""
    info = doc.setdefault("info", {})
    info["description"] = "\n\n".join(filter(None, (info.get("description"), SUMMARY)))
    for _, _, op in operations:
        for param in op.get("parameters", ()):
            if param.get("in") == "query":
                _describe_param(param)


def _describe_param(param: dict[str, Any]) -> None:
    schema = param.get("schema", {})
    branches = schema.get("anyOf", [schema])
    if param["name"] == CURSOR:
        for branch in branches:
            if branch.get("type") == "string":
                branch["minLength"] = 1
        param["description"] = CURSOR_RULE
    elif any(b.get("type") == "integer" for b in branches):
        text = param.get("description")
        param["description"] = f"{text}. {INTEGER_RULE}" if text else INTEGER_RULE
