"""Work leases draw from difficulty pools in proportion to weight × passes queued (SPEC
"Difficulty"): with fixed seeds, a chi-square test over thousands of draws accepts the expected
frequencies, and within a pool the queue order holds. One node: the draw is one script's."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from scipy import stats

from tests.api.test_difficulty import answer, difficulty
from tests.api.test_prompts import register
from tests.helpers import make_run

pytestmark = pytest.mark.one_node

# Prompts per pool (each answered once, with a group mean that puts it there) and weights.
SIZES = {"easy": 2, "normal": 3, "hard": 5}
WEIGHTS = {"easy": 1.0, "normal": 2.0, "hard": 0.5}
MEAN = {"easy": 1.0, "normal": 0.5, "hard": 0.0}
DRAWS = 3000


async def test_draws_follow_weight_times_queued(api, store):
    await make_run(api, "r1", difficulty=difficulty(**WEIGHTS))
    pool_of = {f"{name}{i}": name for name, n in SIZES.items() for i in range(n)}
    await register(api, "r1", *pool_of, epochs=2)
    await answer(api, "r1", {pid: [MEAN[pool]] for pid, pool in pool_of.items()})

    counts = dict.fromkeys(SIZES, 0)
    for seed in range(DRAWS):
        got = await store.work(
            "r1", lease_id=uuid.uuid4().hex, max_prompts=1, generator_id=None, seed=seed
        )
        assert got is not None and len(got.items) == 1
        item = got.items[0]
        assert item.pass_ == 2
        counts[pool_of[item.prompt_id]] += 1
        # Given back unstarted: the pools keep their sizes, so every draw has the same odds.
        assert await store.return_work("r1", got.lease_id, None) == 1

    mass = np.array([WEIGHTS[p] * SIZES[p] for p in SIZES])
    expected = DRAWS * mass / mass.sum()
    observed = np.array([counts[p] for p in SIZES])
    assert stats.chisquare(observed, expected).pvalue > 1e-3, (observed, expected)
    # The same draws against equal odds per pool (weights ignored) or per prompt (pools
    # ignored) are refused: the test tells those rules apart.
    for wrong in (np.ones(3), np.array([SIZES[p] for p in SIZES], dtype=float)):
        assert stats.chisquare(observed, DRAWS * wrong / wrong.sum()).pvalue < 1e-6


async def test_a_pool_hands_out_in_queue_order(api, store):
    await make_run(api, "r1", difficulty=difficulty(easy=0, hard=0))
    await register(api, "r1", "a", "b", "c", "d", epochs=1)
    got = await store.work(
        "r1", lease_id=uuid.uuid4().hex, max_prompts=2, generator_id=None, seed=1
    )
    assert got is not None
    assert [i.prompt_id for i in got.items] == ["a", "b"]
    assert await store.return_work("r1", got.lease_id, ["b"]) == 1
    again = await store.work("r1", lease_id=uuid.uuid4().hex, max_prompts=3, generator_id=None)
    assert again is not None
    assert [i.prompt_id for i in again.items] == ["b", "c", "d"]  # the returned pass first
