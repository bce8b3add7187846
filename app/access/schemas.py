"""Request and response bodies of the token and audit endpoints."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from app.access.policy import Scope
from app.access.tokens import ID_HEX
from app.ids import LedgerText

TOKEN_ID_PATTERN = rf"^[0-9a-f]{{{ID_HEX}}}$"
"""A token's id, as token_hex makes them."""
TokenId = Annotated[str, StringConstraints(pattern=TOKEN_ID_PATTERN), LedgerText]
RUN_PATTERN = r"^(?:[A-Za-z0-9._-]{1,128}|[A-Za-z0-9._-]{0,127}\*)$"
"""A run a token may touch: a run id, or ``prefix*`` for every run id starting with prefix."""
RunPattern = Annotated[str, StringConstraints(pattern=RUN_PATTERN)]
MAX_RUN_PATTERNS = 100
TokenName = Annotated[
    str, StringConstraints(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")
]


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: TokenName = Field(description="Who holds the token; the audit log names it")
    scopes: list[Scope] = Field(min_length=1, max_length=len(Scope))
    runs: list[RunPattern] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_RUN_PATTERNS,
        description="The runs the token may touch (ids or `prefix*`); unset: every run",
    )

    @model_validator(mode="after")
    def _coherent(self) -> TokenCreate:
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
    action: str
    run_id: str | None
    detail: dict[str, Any]


class AuditPage(BaseModel):
    entries: list[AuditItem]
    next_cursor: str | None
