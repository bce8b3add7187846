"""The consumers' figures of a run's accounting (SPEC "Consumers"), from ``consumer_totals``:
per name, delivered, acked and dropped as summed, and pending derived from them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.accounting.models import ConsumerTotals
from app.accounting.schemas import ConsumerCounts

__all__ = ["consumers_of"]


def consumer_counts(row: ConsumerTotals) -> ConsumerCounts:
    """A consumer's figures: what is neither acked nor dropped is pending (or in a live lease)."""
    return ConsumerCounts(
        delivered=row.delivered,
        acked=row.acked,
        pending=row.delivered - row.acked - row.dropped,
        dropped=row.dropped,
    )


async def consumers_of(
    session: AsyncSession, run_ids: Sequence[str]
) -> dict[str, dict[str, ConsumerCounts]]:
    """Per run its consumers' figures by name, in name order; a run without any is left out."""
    rows = await session.scalars(
        select(ConsumerTotals)
        .where(ConsumerTotals.run_id.in_(run_ids))
        .order_by(ConsumerTotals.run_id, ConsumerTotals.name)
    )
    out: dict[str, dict[str, ConsumerCounts]] = defaultdict(dict)
    for row in rows.all():
        out[row.run_id][row.name] = consumer_counts(row)
    return out
