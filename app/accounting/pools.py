"""Difficulty pools as the ledger reads them (SPEC "Difficulty"): a prompt's pool is judged when
read, from the newest mean reward of its groups (``prompt_means``) and the run's current
thresholds (its ``difficulty`` in the ledger's ``runs.config``), so a change of thresholds moves
prompts between pools at once, without rewriting a row. A prompt no group told a mean of yet is
``normal``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.accounting.models import PromptMean, PromptPass, Run
from app.accounting.schemas import PoolCounts

__all__ = [
    "POOLS",
    "Thresholds",
    "pool_condition",
    "pool_of",
    "queued_pools",
    "queued_pools_of",
    "run_thresholds",
    "thresholds_of",
]

POOLS = ("easy", "normal", "hard")


@dataclass(frozen=True, slots=True)
class Thresholds:
    """A run's ``difficulty`` thresholds: easy above ``easy_above``, hard below
    ``hard_below``."""

    easy_above: float
    hard_below: float


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def thresholds_of(config: Mapping[str, Any] | None) -> Thresholds | None:
    """The thresholds of a run's config as the ledger holds it; None without ``difficulty``
    (or with one a config of the broker never has)."""
    difficulty = (config or {}).get("difficulty")
    if not isinstance(difficulty, Mapping):
        return None
    easy, hard = _number(difficulty.get("easy_above")), _number(difficulty.get("hard_below"))
    if easy is None or hard is None:
        return None
    return Thresholds(easy_above=easy, hard_below=hard)


def pool_of(mean: float | None, thresholds: Thresholds) -> str:
    """The pool of a prompt whose newest group mean is ``mean`` (None: none told yet)."""
    if mean is None:
        return "normal"
    if mean > thresholds.easy_above:
        return "easy"
    if mean < thresholds.hard_below:
        return "hard"
    return "normal"


def pool_condition(pool: str, thresholds: Thresholds) -> ColumnElement[bool]:
    """:func:`pool_of` in SQL, on ``PromptMean.mean`` of an outer join (NULL: no mean)."""
    mean = PromptMean.mean
    if pool == "easy":
        return mean > thresholds.easy_above
    if pool == "hard":
        return mean < thresholds.hard_below
    if pool == "normal":
        return or_(
            mean.is_(None), and_(mean <= thresholds.easy_above, mean >= thresholds.hard_below)
        )
    raise ValueError(f"unknown pool {pool!r}")


async def run_thresholds(session: AsyncSession, run_id: str) -> Thresholds | None:
    config = await session.scalar(select(Run.config).where(Run.run_id == run_id))
    return thresholds_of(config)


async def queued_pools(session: AsyncSession, run_id: str) -> PoolCounts | None:
    """The run's queued passes per pool (their sum is its queued passes); None when the run
    has no ``difficulty``. Read in the caller's snapshot, beside the totals."""
    return (await queued_pools_of(session, [run_id]))[run_id]


async def queued_pools_of(
    session: AsyncSession, run_ids: Sequence[str]
) -> dict[str, PoolCounts | None]:
    """:func:`queued_pools` of several runs: one read of their configs, then one count for
    each run with ``difficulty``."""
    configs = await session.execute(select(Run.run_id, Run.config).where(Run.run_id.in_(run_ids)))
    out: dict[str, PoolCounts | None] = dict.fromkeys(run_ids)
    for run_id, config in sorted(configs.all()):
        thresholds = thresholds_of(config)
        if thresholds is not None:
            out[run_id] = await _count_queued(session, run_id, thresholds)
    return out


async def _count_queued(session: AsyncSession, run_id: str, thresholds: Thresholds) -> PoolCounts:
    mean = PromptMean.mean
    pool = case(
        (mean > thresholds.easy_above, "easy"),
        (mean < thresholds.hard_below, "hard"),
        else_="normal",
    )
    rows = await session.execute(
        select(pool, func.count())
        .select_from(PromptPass)
        .outerjoin(
            PromptMean,
            and_(
                PromptMean.run_id == PromptPass.run_id,
                PromptMean.prompt_id == PromptPass.prompt_id,
            ),
        )
        .where(PromptPass.run_id == run_id, PromptPass.state == "queued")
        .group_by(pool)
    )
    counts = dict.fromkeys(POOLS, 0)
    for name, n in rows.all():
        counts[name] = n
    return PoolCounts(**counts)
