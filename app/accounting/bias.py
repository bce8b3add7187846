"""The length bias of what a run trains on (SPEC "Accounting": ``bias.length.ks``), as the ledger
will keep it: each trained-token length counted in a log-spaced histogram, one for the rollouts
received and one for the samples consumed, and the Kolmogorov–Smirnov distance between the two
distributions read from the histograms' cumulative counts.

A bucket holds the lengths ``[2^(i/4), 2^((i+1)/4))`` rounded up to whole tokens: four buckets per
doubling, :data:`BUCKETS` of them up to the largest rollout the broker accepts (2^24 tokens), so
lengths within a bucket differ by at most 19 %. The distance between two histograms is that of
their bucketed samples exactly (the largest gap between the two cumulative distributions, taken
at bucket edges, is where the gap between bucketed samples is largest).

Not served yet: the ledger's columns, the accounting's ``bias`` and its views come with them.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = ["BUCKETS", "EDGES", "bucket_of", "histogram", "ks_distance"]

PER_DOUBLING = 4
MAX_LENGTH = 2**24  # the largest max_tokens_per_rollout a broker takes (app/settings.py)
# The first length of each bucket: ceil(2^(i/4)), without repeats (the first doublings round to
# the same whole lengths), up to MAX_LENGTH.
EDGES: npt.NDArray[np.int64] = np.unique(
    np.array(
        [math.ceil(2 ** (i / PER_DOUBLING)) for i in range(24 * PER_DOUBLING + 1)],
        dtype=np.int64,
    )
)
BUCKETS = int(EDGES.size)


def bucket_of(lengths: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The bucket of each length (≥ 1): the last edge at or below it."""
    n = np.asarray(lengths, dtype=np.int64)
    if n.size and int(n.min()) < 1:
        raise ValueError("a length is at least 1 token")
    return np.searchsorted(EDGES, n, side="right").astype(np.int64) - 1


def histogram(lengths: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The counts per bucket of ``lengths``."""
    return np.bincount(bucket_of(lengths), minlength=BUCKETS).astype(np.int64)


def ks_distance(a: npt.ArrayLike, b: npt.ArrayLike) -> float | None:
    """The Kolmogorov–Smirnov distance between the distributions of two histograms (counts per
    bucket, as :func:`histogram` makes them): the largest gap between their cumulative shares,
    0 for the same distribution, 1 for disjoint ones; None when either is empty."""
    ca = np.cumsum(np.asarray(a, dtype=np.int64))
    cb = np.cumsum(np.asarray(b, dtype=np.int64))
    if not ca.size or not cb.size or ca[-1] == 0 or cb[-1] == 0:
        return None
    return float(np.max(np.abs(ca / ca[-1] - cb / cb[-1])))
