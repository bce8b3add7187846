"""The accounting service: what the operator endpoints ask of the accounting, over the caller's
database session and the run event streams in Redis. The SQL is in ``queries`` (totals),
``ledger`` (the check against the live state) and ``listings`` (pages); this service only
reads, and never commits."""

from __future__ import annotations

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession

from app.accounting import listings, queries, schemas
from app.accounting.stream import EventStream

__all__ = ["AccountingService"]


class AccountingService:
    """The accounting of the runs of one key prefix."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream

    @classmethod
    def create(cls, redis: Redis, prefix: str) -> AccountingService:
        return cls(EventStream(redis, prefix))

    async def run_accounting(self, session: AsyncSession, run_id: str) -> schemas.RunAccounting:
        """Exact totals of the run, as of the newest drained event."""
        return await queries.run_accounting(session, self.stream, run_id)

    async def version_accounting(
        self, session: AsyncSession, run_id: str
    ) -> schemas.VersionsAccounting:
        """The same accounting per policy version of the rollouts."""
        return await queries.version_accounting(session, self.stream, run_id)

    async def training_accounting(
        self, session: AsyncSession, run_id: str
    ) -> schemas.TrainingAccounting:
        """Per policy version of the trainer (the V of the acknowledged batches' leases)."""
        return await queries.training_accounting(session, self.stream, run_id)

    async def generator_accounting(
        self, session: AsyncSession, run_id: str
    ) -> schemas.GeneratorsAccounting:
        """Per generator of the run's rollouts."""
        return await queries.generator_accounting(session, self.stream, run_id)

    async def batches(
        self, session: AsyncSession, run_id: str, *, limit: int, cursor: str | None
    ) -> schemas.BatchPage:
        """The batch ledger in lease order, ``limit`` rows after ``cursor``."""
        return await listings.list_batches(session, self.stream, run_id, limit=limit, cursor=cursor)

    async def prompts(
        self,
        session: AsyncSession,
        run_id: str,
        *,
        state: str | None,
        limit: int,
        cursor: str | None,
        pool: str | None = None,
    ) -> schemas.PromptPage:
        """The prompt ledger in (prompt_id, pass) order, of one state or all, of one
        difficulty pool or all."""
        return await listings.list_prompts(
            session, self.stream, run_id, state=state, limit=limit, cursor=cursor, pool=pool
        )

    async def dead_letters(
        self, session: AsyncSession, run_id: str, *, limit: int, cursor: str | None
    ) -> schemas.DeadLetterPage:
        """The run's dead letters, oldest first."""
        return await listings.dead_letters(session, self.stream, run_id, limit=limit, cursor=cursor)
