"""The token cache under a flood of unknown token ids: they are remembered apart from the known
tokens (never evicting one), and their database cost is bounded, counted in queries: one query
at a time per id, and a budget of look-ups of ids the process does not know."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app import keys
from app.access import tokens
from app.access.policy import Scope
from app.caller import Caller
from app.errors import Unavailable

pytestmark = pytest.mark.one_node


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def queries(engine: AsyncEngine) -> list[str]:
    """Every statement on ``api_tokens`` sent to Postgres by the test."""
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "api_tokens" in statement:
            seen.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    return seen


@pytest.fixture
async def clock() -> Clock:
    return Clock()


@pytest.fixture
async def cache(
    sessionmaker: async_sessionmaker[AsyncSession], redis: Redis, prefix: str, clock: Clock
) -> AsyncIterator[tokens.TokenCache]:
    cache = tokens.TokenCache(
        sessionmaker, redis, keys.tokens_channel(prefix), ttl_s=60.0, clock=clock
    )
    await cache.start()
    yield cache
    await cache.stop()


async def _known_token(sessionmaker: async_sessionmaker[AsyncSession]) -> str:
    async with sessionmaker() as session, session.begin():
        _, token = await tokens.insert_token(session, "known", [Scope.TRAIN], None, "test")
    return token


def _unknown(n: int) -> list[str]:
    return [f"rb_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}" for _ in range(n)]


async def _callers(cache: tokens.TokenCache, presented: list[str]) -> list[Any]:
    return await asyncio.gather(*(cache.caller(t) for t in presented), return_exceptions=True)


async def test_a_flood_of_unknown_ids_costs_a_bounded_number_of_queries_and_evicts_nothing(
    cache: tokens.TokenCache,
    sessionmaker: async_sessionmaker[AsyncSession],
    queries: list[str],
    clock: Clock,
) -> None:
    known = await _known_token(sessionmaker)
    caller = await cache.caller(known)
    assert isinstance(caller, Caller) and caller.name == "known"
    queries.clear()

    answers = await _callers(cache, _unknown(10_000))
    looked_up = len(queries)
    budget = tokens.LOOKUP_BURST - 1  # the known token's first look-up drew on it
    assert looked_up == budget
    assert answers.count(None) == budget
    refused = [a for a in answers if isinstance(a, Unavailable)]
    assert len(refused) == 10_000 - budget
    assert refused[0].headers == {"Retry-After": "1"}

    # The known token is still cached: no query for it, during the flood or after it.
    assert await cache.caller(known) == caller
    assert len(queries) == looked_up

    # The budget refills at LOOKUP_RATE a second.
    clock.now += 1.0
    answers = await _callers(cache, _unknown(1000))
    assert len(queries) - looked_up == tokens.LOOKUP_RATE
    assert sum(isinstance(a, Unavailable) for a in answers) == 1000 - tokens.LOOKUP_RATE


async def test_one_unknown_id_presented_at_once_by_many_requests_is_one_query(
    cache: tokens.TokenCache, queries: list[str], clock: Clock
) -> None:
    [token] = _unknown(1)
    assert await _callers(cache, [token] * 500) == [None] * 500
    assert len(queries) == 1
    # Remembered for NEGATIVE_S, then looked up again.
    assert await cache.caller(token) is None and len(queries) == 1
    clock.now += tokens.NEGATIVE_S
    assert await cache.caller(token) is None and len(queries) == 2


async def test_unknown_ids_are_remembered_up_to_their_own_bound(
    cache: tokens.TokenCache,
    sessionmaker: async_sessionmaker[AsyncSession],
    queries: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tokens, "MAX_UNKNOWN", 3)
    known = await _known_token(sessionmaker)
    assert await cache.caller(known) is not None
    first, *rest = _unknown(4)
    for token in (first, *rest):
        assert await cache.caller(token) is None
    queries.clear()
    for token in rest:  # the newest three are remembered ...
        assert await cache.caller(token) is None
    assert queries == []
    assert await cache.caller(first) is None  # ... the oldest was forgotten
    assert len(queries) == 1
    assert await cache.caller(known) is not None and len(queries) == 1


async def test_a_known_token_due_for_a_fresh_look_does_not_wait_on_the_budget(
    cache: tokens.TokenCache,
    sessionmaker: async_sessionmaker[AsyncSession],
    queries: list[str],
    clock: Clock,
) -> None:
    known = await _known_token(sessionmaker)
    assert await cache.caller(known) is not None
    await _callers(cache, _unknown(tokens.LOOKUP_BURST + 1))  # the budget is spent
    clock.now += 60.0  # the known token's entry is out of date: looked up again
    queries.clear()
    assert await cache.caller(known) is not None
    assert len(queries) == 1


def test_only_a_token_id_of_hex_digits_reaches_the_database() -> None:
    secret = secrets.token_urlsafe(32)
    assert tokens.split_token(f"rb_0123456789abcdef_{secret}") == ("0123456789abcdef", secret)
    for token_id in ("0123456789abcde\x00", "0123456789ABCDEF", "0123456789abcdeg", "é" * 16):
        assert tokens.split_token(f"rb_{token_id}_{secret}") is None, token_id
