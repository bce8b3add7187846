"""The fold of the bias figures (length histograms, reward counts and sums) from constructed
events: whatever the order events are folded in, and whatever the order batches of them are
applied to the ledger in, the tables and the answer's ``bias`` are those of a numpy recompute,
a rollout whose tokens are all masked (trained length 0) included."""

from __future__ import annotations

import random
from typing import Any

import httpx
import numpy as np
import pytest
from accounting_helpers import apply_batches, event_at
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting.bias import bucket_of
from app.accounting.fold import fold_events
from app.accounting.models import LengthCount, RunTotals
from app.events import (
    Accepted,
    AcceptedItem,
    Acked,
    AckedItem,
    AckStats,
    AckSums,
    Event,
    Scored,
    ScoredItem,
)

# The fold and the ledger are the subject; Redis serves only the reads' pending counts.
pytestmark = pytest.mark.one_node


class Workload:
    """Accepted rollouts (some posted without a reward, some with every token masked), some
    scored later, and acks of samples of them, each with the reward known at hand-out."""

    def __init__(self, run_id: str, seed: int) -> None:
        rng = random.Random(seed)
        self.generated: list[int] = []
        self.trained: list[int] = []
        self.rewards_generated: list[float] = []
        self.rewards_trained: list[float] = []
        self.events: list[Event] = []
        lengths: dict[str, int] = {}
        rewards: dict[str, float] = {}
        unscored: list[str] = []
        n = 0
        for batch in range(8):
            items, told = [], []
            for i in range(rng.randint(1, 6)):
                rid = f"r{batch}-{i}"
                tokens = rng.choice([1, 3, 17, 64, 500, 4096])
                masked = tokens if i == 0 and batch % 3 == 0 else rng.randint(0, tokens - 1)
                awaiting = rng.random() < 0.3
                items.append(AcceptedItem(rid, rid, 0, tokens, True, masked, awaiting))
                lengths[rid] = tokens - masked
                self.generated.append(tokens - masked)
                if awaiting:
                    unscored.append(rid)
                else:
                    rewards[rid] = rng.choice([-1.0, 0.0, 0.5, 1.0, 2.5])
                    told.append(rewards[rid])
            self.rewards_generated += told
            n += 1
            body = Accepted(tuple(items), len(told) or None, sum(told) if told else None)
            self.events.append(event_at(run_id, n, "accepted", body))
        scored = unscored[::2]
        for rid in scored:
            rewards[rid] = rng.uniform(-3, 3)
            self.rewards_generated.append(rewards[rid])
        n += 1
        items = tuple(ScoredItem(rid, 0, rewards[rid], 10, False) for rid in scored)
        self.events.append(event_at(run_id, n, "scored", Scored(items)))
        pool = sorted(lengths)
        for b in range(6):
            picked = rng.sample(pool, rng.randint(1, 5))
            acked = []
            for rid in picked:
                reward = rewards.get(rid)  # a sample whose reward is unknown tells none
                acked.append(AckedItem(rid, 0, lengths[rid], None, 0, None, reward))
                self.trained.append(lengths[rid])
                if reward is not None:
                    self.rewards_trained.append(reward)
            n += 1
            body = Acked(f"b{b}", None, 1, tuple(acked), AckStats(), AckSums())
            self.events.append(event_at(run_id, n, "acked", body))

    def histogram(self, side: str) -> dict[int, int]:
        values = self.generated if side == "generated" else self.trained
        buckets, counts = np.unique(bucket_of(values), return_counts=True)
        return {int(b): int(c) for b, c in zip(buckets, counts, strict=True)}


def test_the_fold_is_order_free_and_equals_a_recompute() -> None:
    work = Workload("run-f", seed=7)
    assert 0 in work.generated  # a rollout with every token masked
    rng = random.Random(11)
    for _ in range(20):
        events = work.events[:]
        rng.shuffle(events)
        fold = fold_events(events)
        for side in ("generated", "trained"):
            got = {b: n for (s, b), n in fold.lengths.items() if s == side}
            assert got == work.histogram(side), side
        assert fold.run.reward_generated_n == len(work.rewards_generated)
        assert fold.run.reward_generated_sum == pytest.approx(sum(work.rewards_generated))
        assert fold.run.reward_trained_n == len(work.rewards_trained)
        assert fold.run.reward_trained_sum == pytest.approx(sum(work.rewards_trained))


async def _tables(sm: async_sessionmaker[AsyncSession], run_id: str) -> tuple[Any, ...]:
    async with sm() as s:
        lengths = (
            await s.execute(
                select(LengthCount.side, LengthCount.bucket, LengthCount.rollouts)
                .where(LengthCount.run_id == run_id)
                .order_by(LengthCount.side, LengthCount.bucket)
            )
        ).all()
        totals = await s.get(RunTotals, run_id)
        assert totals is not None
        sums = (
            totals.reward_generated_n,
            round(totals.reward_generated_sum, 9),
            totals.reward_trained_n,
            round(totals.reward_trained_sum, 9),
        )
    return tuple(lengths), sums


async def test_batches_applied_in_any_order_give_the_same_tables_and_figures(
    sessionmaker: async_sessionmaker[AsyncSession], accounting_api: httpx.AsyncClient
) -> None:
    tag = random.Random().getrandbits(32)
    in_order, shuffled = f"bias-in-order-{tag}", f"bias-shuffled-{tag}"
    await apply_batches(sessionmaker, in_order, [Workload(in_order, seed=3).events])
    work = Workload(shuffled, seed=3)
    chunks = [work.events[i : i + 3] for i in range(0, len(work.events), 3)]
    random.Random(5).shuffle(chunks)
    await apply_batches(
        sessionmaker, shuffled, [[e] for e in work.events[-2:]] + chunks
    )  # some twice
    assert await _tables(sessionmaker, in_order) == await _tables(sessionmaker, shuffled)

    bias = (await accounting_api.get(f"/v1/runs/{shuffled}/accounting")).json()["bias"]
    length, reward = bias["length"], bias["reward"]
    assert length["generated_mean"] == pytest.approx(np.mean(work.generated), abs=1e-12)
    assert length["trained_mean"] == pytest.approx(np.mean(work.trained), abs=1e-12)
    assert reward["generated_mean"] == pytest.approx(np.mean(work.rewards_generated))
    assert reward["trained_mean"] == pytest.approx(np.mean(work.rewards_trained))
    assert length["histogram"]["generated"]["0"] == work.generated.count(0)
    cdf = {
        side: np.cumsum(np.bincount(bucket_of(values), minlength=100)) / len(values)
        for side, values in (("g", work.generated), ("t", work.trained))
    }
    assert length["ks"] == pytest.approx(float(np.max(np.abs(cdf["g"] - cdf["t"]))), abs=1e-12)
