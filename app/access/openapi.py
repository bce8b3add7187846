"""What access adds to the API description (:class:`app.api.OpenAPIPart`): which operations the
guard stands before and what it may answer there (from the access table,
:data:`app.access.policy.ROUTES`), the admin-scope rule of a new token, and the token id format."""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel

from app.access.policy import PUBLIC, Scope, need_of
from app.access.schemas import TOKEN_ID_PATTERN, TokenCreate
from app.api import Keywords, OpenAPIPart
from app.settings import Settings


def guard_errors(method: str, path: str, auth: bool) -> frozenset[int] | None:
    """What the guard may answer for ``method path`` (a path template): with auth on, 401 (no
    token, or an unknown one) and 403 (a token short of the need); with auth off, 403 to a
    request addressed to a host name the broker does not serve, or to one that changes state
    from another web origin. None for a public operation."""
    if need_of(method.upper(), path) == PUBLIC:
        return None
    return frozenset({401, 403}) if auth else frozenset({403})


def field_keywords(_: Settings) -> dict[tuple[type[BaseModel], str], Keywords]:
    return {(TokenCreate, "scopes"): {"uniqueItems": True}}


OPENAPI: Final = OpenAPIPart(
    field_keywords=field_keywords,
    model_rules={
        TokenCreate: {  # an admin token touches every run: it names none
            "if": {
                "properties": {"scopes": {"contains": {"const": Scope.ADMIN.value}}},
                "required": ["scopes"],
            },
            "then": {"properties": {"runs": {"type": "null"}}},
        },
    },
    path_ids={"token_id": TOKEN_ID_PATTERN},
    guard=guard_errors,
)
"""Access's part of the API description."""
