"""The length-bias figures (app/accounting/bias.py) against a numpy recompute on the bucketed
samples: identical distributions give 0, disjoint ones 1, a known shift its exact distance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.accounting.bias import BUCKETS, EDGES, bucket_of, bucket_of_one, histogram, ks_distance


def ks_of_samples(x: np.ndarray, y: np.ndarray) -> float:
    """The two-sample KS statistic, computed directly: the largest gap between the empirical
    CDFs, over every value either sample takes."""
    values = np.union1d(x, y)
    fx = np.searchsorted(np.sort(x), values, side="right") / x.size
    fy = np.searchsorted(np.sort(y), values, side="right") / y.size
    return float(np.max(np.abs(fx - fy)))


def test_buckets_are_log_spaced_and_cover_every_length():
    assert BUCKETS >= 32
    assert EDGES[0] == 0 and EDGES[1] == 1 and EDGES[-1] == 2**24
    assert np.all(np.diff(EDGES) > 0)
    ratios = EDGES[2:] / EDGES[1:-1]
    assert float(ratios[EDGES[1:-1] >= 64].max()) <= 2 ** (1 / 4) + 0.02  # 4 per doubling
    # Length 0 (every token masked) has a bucket of its own, below that of length 1.
    assert bucket_of([0, 1, 2, 1023, 1024, 2**24]).tolist() == [
        0,
        1,
        int(np.searchsorted(EDGES, 2, "right")) - 1,
        int(np.searchsorted(EDGES, 1023, "right")) - 1,
        int(np.searchsorted(EDGES, 1024, "right")) - 1,
        BUCKETS - 1,
    ]
    with pytest.raises(ValueError):
        bucket_of([-1])


def test_identical_disjoint_and_empty():
    rng = np.random.default_rng(1)
    x = rng.integers(1, 5000, 2000)
    assert ks_distance(histogram(x), histogram(x)) == 0.0
    assert ks_distance(histogram(x), histogram(np.concatenate([x, x]))) == 0.0
    assert ks_distance(histogram([3, 4, 5]), histogram([900, 1000])) == 1.0
    assert ks_distance(histogram([]), histogram([5])) is None
    # All tokens masked against one trained token: disjoint too.
    assert ks_distance(histogram([0, 0]), histogram([1])) == 1.0


def test_a_known_shift():
    # Half the trained samples in a bucket far above the rest, against none there: 0.5.
    short = [10] * 100
    assert ks_distance(histogram(short), histogram([10] * 50 + [5000] * 50)) == 0.5


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**20), min_size=1, max_size=300),
    st.lists(st.integers(0, 2**20), min_size=1, max_size=300),
)
def test_the_distance_is_that_of_the_bucketed_samples(x, y):
    bx, by = bucket_of(x), bucket_of(y)
    assert [bucket_of_one(n) for n in x] == bx.tolist()  # the fold's, one at a time
    assert ks_distance(histogram(x), histogram(y)) == pytest.approx(
        ks_of_samples(bx, by), abs=1e-12
    )
