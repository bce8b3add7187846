"""Request and response bodies of the token and audit endpoints."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from app.access.policy import ANONYMOUS, Scope
from app.access.tokens import BOOTSTRAP_NAME, ID_HEX
from app.ids import LedgerText

TOKEN_ID_PATTERN = rf"^[0-9a-f]{{{ID_HEX}}}$"
"""A token's id, as token_hex makes them."""
TokenId = Annotated[str, StringConstraints(pattern=TOKEN_ID_PATTERN), LedgerText]
RUN_PATTERN = r"^(?:[A-Za-z0-9._-]{1,128}|[A-Za-z0-9._-]{0,127}\*)$"
"""A run a token may touch: a run id, or ``prefix*`` for every run id starting with prefix."""
RunPattern = Annotated[str, StringConstraints(pattern=RUN_PATTERN)]
MAX_RUN_PATTERNS = 100
RESERVED_NAMES = frozenset({BOOTSTRAP_NAME, ANONYMOUS.name})
"""The names the audit log gives callers that are not tokens: ``BROKER_ADMIN_TOKEN`` and, with
auth off, everybody."""
# The audit log names callers by it, so it holds nothing a reader cannot see: no control
# characters (C0, DEL, C1) and no invisible or direction-changing format characters (zero-width
# marks and joiners, bidi embeddings, overrides and isolates, the byte-order mark), with which
# one name could be shown as another.
HIDDEN_CHARACTERS = "\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff"
TokenName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=100, pattern=f"^[^{HIDDEN_CHARACTERS}]+$"),
]


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: TokenName = Field(
        description="Who holds the token; the audit log names it. Unique among live tokens "
        "(another live token's name is 409 TokenNameTaken; a revoked token's may be reused); "
        f"never {' or '.join(sorted(RESERVED_NAMES))}, whatever the case"
    )
    scopes: list[Scope] = Field(min_length=1, max_length=len(Scope))
    runs: list[RunPattern] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_RUN_PATTERNS,
        description="The runs the token may touch (ids or `prefix*`); unset: every run",
    )

    @model_validator(mode="after")
    def _coherent(self) -> TokenCreate:
        if self.name.strip().casefold() in RESERVED_NAMES:
            raise ValueError(
                f"name: {self.name!r} is reserved (the audit log's name for a caller "
                "that is not a token)"
            )
        if len(set(self.scopes)) != len(self.scopes):
            raise ValueError("scopes: each scope at most once")
        if Scope.ADMIN in self.scopes and self.runs is not None:
            raise ValueError("runs: an admin token touches every run (it manages all tokens)")
        return self


class TokenInfo(BaseModel):
    token_id: str
    name: str
    scopes: list[Scope]
    runs: list[str] | None
    created_at: str
    created_by: str
    revoked_at: str | None


class TokenCreated(BaseModel):
    token_id: str
    token: str = Field(description="The secret: shown here once, stored only as a digest")
    name: str
    scopes: list[Scope]
    runs: list[str] | None
    created_at: str


class TokenList(BaseModel):
    tokens: list[TokenInfo]


class AuditItem(BaseModel):
    id: int
    at: str
    actor: str = Field(description="The name of the token that acted")
    token_id: str | None = Field(
        description="The id of the token that acted, which tells tokens of one name apart "
        f"(a revoked token's name may be reused): `{BOOTSTRAP_NAME}` for BROKER_ADMIN_TOKEN, "
        "null with auth off"
    )
    action: str
    run_id: str | None
    detail: dict[str, Any]


class AuditPage(BaseModel):
    entries: list[AuditItem]
    next_cursor: str | None
