"""Tokens (``/v1/tokens``, admin) and the audit log (``/v1/audit``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app import keys
from app.access import audit
from app.access.models import ApiToken
from app.access.schemas import (
    AuditItem,
    AuditPage,
    TokenCreate,
    TokenCreated,
    TokenId,
    TokenInfo,
    TokenList,
)
from app.access.tokens import TokenCache, insert_token, list_tokens, revoke_token
from app.api import (
    SMALL_BODY_BYTES,
    Session,
    caller_of,
    errors,
    read_model,
    render,
    request_body,
    settings_of,
)
from app.caller import check_run
from app.errors import TokenNotFound
from app.ids import RUN_ID_PATTERN

router = APIRouter(tags=["access"])


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at is not None else None


def _info(row: ApiToken) -> TokenInfo:
    return TokenInfo(
        token_id=row.token_id,
        name=row.name,
        scopes=row.scopes,  # validated on the way in
        runs=row.runs,
        created_at=row.created_at.isoformat(),
        created_by=row.created_by,
        revoked_at=_iso(row.revoked_at),
    )


@router.post(
    "/v1/tokens",
    response_model=TokenCreated,
    status_code=201,
    openapi_extra=request_body(TokenCreate),
    responses=errors((409, "TokenNameTaken: a live token has this name")),
)
async def create_token(request: Request, session: Session) -> Response:
    """A new token; its secret is in this answer only."""
    req = await read_model(request, TokenCreate, limit=SMALL_BODY_BYTES)
    caller = caller_of(request)
    async with session.begin():
        row, token = await insert_token(session, req.name, req.scopes, req.runs, caller.name)
        audit.add(
            session,
            caller,
            "token.create",
            None,
            {"token_id": row.token_id, "name": req.name, "scopes": req.scopes, "runs": req.runs},
        )
    info = _info(row)
    out = TokenCreated(token=token, **info.model_dump(exclude={"created_by", "revoked_at"}))
    return render(out, status_code=201)


@router.get("/v1/tokens", response_model=TokenList)
async def get_tokens(session: Session) -> Response:
    """Every token, newest first, revoked ones included; never a secret."""
    return render(TokenList(tokens=[_info(r) for r in await list_tokens(session)]))


@router.delete("/v1/tokens/{token_id}", status_code=204)
async def delete_token(token_id: TokenId, request: Request, session: Session) -> Response:
    """Revoke a token: every API process refuses it within a second."""
    async with session.begin():
        row = await revoke_token(session, token_id)
        if row is None:
            raise TokenNotFound(f"no token {token_id!r}")
        audit.add(session, caller_of(request), "token.revoke", None, {"token_id": token_id})
    tokens: TokenCache | None = getattr(request.app.state, "tokens", None)
    if tokens is not None:
        await tokens.announce_revoked(token_id)
    else:
        await request.app.state.redis.publish(
            keys.tokens_channel(settings_of(request).redis_prefix), token_id
        )
    return Response(status_code=204)


@router.get("/v1/audit", response_model=AuditPage)
async def get_audit(
    request: Request,
    session: Session,
    run_id: Annotated[str | None, Query(pattern=RUN_ID_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[
        str | None, Query(pattern=r"^[0-9]{1,18}$", description="A previous page's next_cursor")
    ] = None,
) -> Response:
    """Operator actions, newest first: who did what to which run, when, with what."""
    caller = caller_of(request)
    if run_id is not None:
        check_run(caller, run_id)
    rows, after = await audit.entries(
        session, caller, run_id, limit, int(cursor) if cursor else None
    )
    items = [
        AuditItem(
            id=r.id,
            at=r.at.isoformat(),
            actor=r.actor,
            token_id=r.token_id or None,
            action=r.action,
            run_id=r.run_id,
            detail=r.detail,
        )
        for r in rows
    ]
    return render(AuditPage(entries=items, next_cursor=str(after) if after else None))
