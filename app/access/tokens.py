"""Bearer tokens: their form, their storage in Postgres (only a SHA-256 digest of the secret)
and the per-process cache of look-ups, which Redis pub/sub invalidates on every process when a
token is revoked.

A token reads ``rb_<token_id>_<secret>``: the id (16 hex digits) finds the record without
depending on the secret, and the secret (32 random bytes, URL-safe base64) is compared with the
stored digest in constant time (:func:`hmac.compare_digest`). Secrets of 256 random bits need
no slow hash: nobody can guess one from its SHA-256.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from redis.asyncio import Redis
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.access.models import LIVE_NAME_INDEX, ApiToken
from app.access.policy import Scope
from app.caller import Caller
from app.errors import TokenNameTaken, Unavailable
from app.pubsub import Subscription

log = logging.getLogger("rollout_broker")

TOKEN_PREFIX: Final = "rb_"
ID_HEX: Final = 16
SECRET_BYTES: Final = 32
BOOTSTRAP_NAME: Final = "bootstrap"
NEGATIVE_S: Final = 1.0
"""An unknown token id is remembered this long, so a client with a wrong token does not send
the database one query per request."""
MAX_CACHED: Final = 10_000
"""Known tokens cached per process (the oldest forgotten first beyond it)."""
MAX_UNKNOWN: Final = 10_000
"""Unknown token ids remembered per process, apart from the known ones."""
LOOKUP_RATE: Final = 50.0
LOOKUP_BURST: Final = 100
"""Look-ups of token ids a process does not know: at most LOOKUP_BURST at once, refilled at
LOOKUP_RATE a second (a legitimate token is looked up once per BROKER_TOKEN_CACHE_S)."""


_HEX_ID: Final = re.compile(f"[0-9a-f]{{{ID_HEX}}}")


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def new_token() -> tuple[str, str, bytes]:
    """A fresh ``(token_id, token, digest of its secret)``."""
    token_id = secrets.token_hex(ID_HEX // 2)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return token_id, f"{TOKEN_PREFIX}{token_id}_{secret}", digest(secret)


def split_token(token: str) -> tuple[str, str] | None:
    """``(token_id, secret)`` of a well-formed token, else None."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    token_id, sep, secret = token[len(TOKEN_PREFIX) :].partition("_")
    if not sep or not _HEX_ID.fullmatch(token_id) or not secret:
        return None
    return token_id, secret


@dataclass(frozen=True, slots=True)
class TokenRecord:
    caller: Caller
    secret_sha256: bytes
    revoked: bool


def _record(row: ApiToken) -> TokenRecord:
    caller = Caller(
        token_id=row.token_id,
        name=row.name,
        scopes=frozenset(Scope(s) for s in row.scopes),
        runs=tuple(row.runs) if row.runs is not None else None,
    )
    return TokenRecord(caller, row.secret_sha256, row.revoked_at is not None)


# -- storage ------------------------------------------------------------------------------------


async def insert_token(
    session: AsyncSession,
    name: str,
    scopes: Sequence[Scope],
    runs: Sequence[str] | None,
    created_by: str,
) -> tuple[ApiToken, str]:
    """Add a token (in the caller's transaction); returns its row and the secret token. A live
    token's name is unique (the database's partial unique index holds it against concurrent
    creations): another live token of ``name`` is :class:`TokenNameTaken`."""
    token_id, token, sha = new_token()
    row = ApiToken(
        token_id=token_id,
        name=name,
        scopes=[str(s) for s in scopes],
        runs=list(runs) if runs is not None else None,
        secret_sha256=sha,
        created_by=created_by,
    )
    session.add(row)
    try:
        await session.flush()
    except IntegrityError as exc:
        if LIVE_NAME_INDEX not in str(exc.orig):
            raise
        raise TokenNameTaken(
            f"a live token is named {name!r} already: choose another name, or revoke that "
            "token first (a revoked token's name may be reused)"
        ) from None
    await session.refresh(row)
    return row, token


async def list_tokens(session: AsyncSession) -> list[ApiToken]:
    rows = await session.scalars(select(ApiToken).order_by(ApiToken.created_at.desc()))
    return list(rows)


async def revoke_token(session: AsyncSession, token_id: str) -> ApiToken | None:
    """Mark a token revoked (once; revoking again keeps the first time). None: no such token."""
    row = await session.get(ApiToken, token_id, with_for_update=True)
    if row is not None and row.revoked_at is None:
        await session.execute(
            update(ApiToken).where(ApiToken.token_id == token_id).values(revoked_at=_now())
        )
        await session.refresh(row)
    return row


def _now() -> datetime:
    from datetime import UTC

    return datetime.now(UTC)


# -- look-ups -----------------------------------------------------------------------------------


class _Budget:
    """A token bucket: at most ``burst`` at once, refilled at ``rate`` a second."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._clock = clock
        self._level = float(burst)
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._level = min(self._burst, self._level + (now - self._at) * self._rate)
        self._at = now
        if self._level < 1:
            return False
        self._level -= 1
        return True


class TokenCache:
    """Token records by id, as Postgres had them, for at most ``ttl_s`` (a revocation reaches
    every process at once through :meth:`listen`; the ttl bounds what a lost message costs).
    While the subscription is down nothing cached is trusted.

    Ids Postgres does not know are remembered apart, for :data:`NEGATIVE_S`, at most
    :data:`MAX_UNKNOWN` of them (the oldest forgotten first), so a flood of made-up ids never
    evicts a known token. Their database cost is bounded: one query at a time per id, however
    many requests present it, and looking up an id not known before draws on a budget of
    :data:`LOOKUP_BURST` queries refilled at :data:`LOOKUP_RATE` a second; past it the request
    is ``503`` with ``Retry-After`` (a known token, even one due for a fresh look, never waits
    on the budget)."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession] | None,
        redis: Redis,
        channel: str,
        ttl_s: float,
        bootstrap: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._redis = redis
        self._channel = channel
        self._ttl_s = ttl_s
        self._bootstrap = digest(bootstrap) if bootstrap else None
        self._clock = clock
        self._known: dict[str, tuple[TokenRecord, float]] = {}
        self._unknown: dict[str, float] = {}
        self._pending: dict[str, asyncio.Future[TokenRecord | None]] = {}
        self._budget = _Budget(LOOKUP_RATE, LOOKUP_BURST, clock)
        self._subscribed = False
        self._subscription = Subscription(
            redis, channel, self.forget, on_up=self._up, on_lost=self._lost, name="token-cache"
        )

    # The caller of a presented token, or None for an unknown, wrong or revoked one.
    async def caller(self, token: str) -> Caller | None:
        parts = split_token(token)
        if parts is None:
            return self._bootstrap_caller(token)
        token_id, secret = parts
        record = await self._record(token_id)
        if record is None:
            return self._bootstrap_caller(token)  # an admin token may look like ours
        if record.revoked:
            return None
        if not hmac.compare_digest(digest(secret), record.secret_sha256):
            return None
        return record.caller

    def _bootstrap_caller(self, token: str) -> Caller | None:
        """BOOTSTRAP for ``BROKER_ADMIN_TOKEN`` (checked only for tokens not of the ``rb_``
        form, so database tokens pay no second digest)."""
        if self._bootstrap is not None and hmac.compare_digest(digest(token), self._bootstrap):
            return BOOTSTRAP
        return None

    async def _record(self, token_id: str) -> TokenRecord | None:
        now = self._clock()
        known = self._known.get(token_id)
        if self._subscribed:
            if known is not None and known[1] > now:
                return known[0]
            if self._unknown.get(token_id, now) > now:
                return None
        if self._sessionmaker is None:
            return None
        pending = self._pending.get(token_id)
        if pending is None:
            if known is None and not self._budget.take():
                raise Unavailable(
                    "too many look-ups of tokens this process does not know; retry shortly",
                    retry_after_s=1,
                )
            pending = asyncio.ensure_future(self._look_up(token_id))
            self._pending[token_id] = pending
            pending.add_done_callback(lambda done: self._looked_up(token_id, done))
        return await asyncio.shield(pending)

    async def _look_up(self, token_id: str) -> TokenRecord | None:
        assert self._sessionmaker is not None
        async with self._sessionmaker() as session:
            row = await session.get(ApiToken, token_id)
        return _record(row) if row is not None else None

    def _looked_up(self, token_id: str, done: asyncio.Future[TokenRecord | None]) -> None:
        """Remember what the look-up of ``token_id`` found (its error is its waiters')."""
        self._pending.pop(token_id, None)
        if done.cancelled() or done.exception() is not None:
            return
        record, now = done.result(), self._clock()
        self._known.pop(token_id, None)
        self._unknown.pop(token_id, None)
        if record is None:
            if len(self._unknown) >= MAX_UNKNOWN:
                del self._unknown[next(iter(self._unknown))]
            self._unknown[token_id] = now + NEGATIVE_S
        else:
            if len(self._known) >= MAX_CACHED:
                del self._known[next(iter(self._known))]
            self._known[token_id] = (record, now + self._ttl_s)

    def forget(self, token_id: str) -> None:
        self._known.pop(token_id, None)
        self._unknown.pop(token_id, None)

    async def announce_revoked(self, token_id: str) -> None:
        """Tell every process (this one included) to forget ``token_id``."""
        self.forget(token_id)
        await self._redis.publish(self._channel, token_id)

    # -- the subscription --

    async def start(self) -> None:
        await self._subscription.start()

    async def stop(self) -> None:
        await self._subscription.stop()

    def _up(self) -> None:
        # Whatever was revoked while nobody listened: every known token is due for a fresh look
        # (still known, so not drawing on the budget); unknown ids stay unknown.
        self._known = {tid: (record, -math.inf) for tid, (record, _) in self._known.items()}
        self._subscribed = True

    def _lost(self) -> None:
        self._subscribed = False


BOOTSTRAP: Final = Caller(
    token_id=BOOTSTRAP_NAME, name=BOOTSTRAP_NAME, scopes=frozenset({Scope.ADMIN}), runs=None
)
"""The caller of ``BROKER_ADMIN_TOKEN``."""
