"""The length bias of what a run trains on (SPEC "Accounting": ``bias.length.ks``), as the ledger
keeps it: each trained-token length counted in a log-spaced histogram, one for the rollouts
received and one for the samples consumed, and the Kolmogorov–Smirnov distance between the two
distributions read from the histograms' cumulative counts.

Bucket 0 holds length 0, no token trained: ingest refuses a rollout posted with every token
masked, but an event that tells such a length still folds rather than dead-letters. Every other
holds the lengths ``[2^(i/4), 2^((i+1)/4))`` rounded up to whole tokens: four buckets per
doubling up to the largest rollout the broker accepts (2^24 tokens), :data:`BUCKETS` in all, so
lengths within a bucket differ by at most 19 %. The distance between two histograms is that of
their bucketed samples exactly (the largest gap between the two cumulative distributions, taken
at bucket edges, is where the gap between bucketed samples is largest).

The ledger keeps the counts per (run, side, bucket) in ``length_counts``, the bucket being its
index here: the edges may only ever grow at the top, or stored rows would change meaning.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping
from decimal import Decimal

import numpy as np
import numpy.typing as npt

from app.accounting.models import RunTotals
from app.accounting.schemas import BiasStats, LengthBias, LengthHistograms, RewardBias

__all__ = [
    "BUCKETS",
    "EDGES",
    "bias_stats",
    "bucket_of",
    "bucket_of_one",
    "histogram",
    "ks_distance",
]

PER_DOUBLING = 4
MAX_LENGTH = 2**24  # the largest max_tokens_per_rollout a broker takes (app/settings.py)
# The first length of each bucket: 0, then ceil(2^(i/4)) without repeats (the first doublings
# round to the same whole lengths), up to MAX_LENGTH.
EDGES: npt.NDArray[np.int64] = np.unique(
    np.array(
        [0, *(math.ceil(2 ** (i / PER_DOUBLING)) for i in range(24 * PER_DOUBLING + 1))],
        dtype=np.int64,
    )
)
BUCKETS = int(EDGES.size)
_EDGE_LIST = [int(e) for e in EDGES]


def bucket_of(lengths: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The bucket of each length (≥ 0): the last edge at or below it."""
    n = np.asarray(lengths, dtype=np.int64)
    if n.size and int(n.min()) < 0:
        raise ValueError("a length is at least 0 tokens")
    return np.searchsorted(EDGES, n, side="right").astype(np.int64) - 1


def bucket_of_one(length: int) -> int:
    """:func:`bucket_of` of one length, without numpy (the fold's, one per rollout)."""
    if length < 0:
        raise ValueError("a length is at least 0 tokens")
    return bisect_right(_EDGE_LIST, length) - 1


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


def _mean(total: int | float, n: int) -> float | None:
    if not n:
        return None
    if isinstance(total, int):
        return float(Decimal(total) / n)  # exactly: a token sum may be beyond a double's 2^53
    return total / n


def _counts(per_bucket: Mapping[int, int]) -> npt.NDArray[np.int64]:
    counts = np.zeros(BUCKETS, dtype=np.int64)
    for bucket, n in per_bucket.items():
        counts[bucket] = n
    return counts


def bias_stats(totals: RunTotals, lengths: Mapping[str, Mapping[int, int]]) -> BiasStats:
    """A run's ``bias`` from its totals row and its ``length_counts`` (side -> bucket ->
    rollouts). The length means come from the totals, which count the same rollouts as the
    histograms, exactly: Σ (tokens − masked) over the accepted items for the rollouts received,
    Σ trained tokens over the acked items for the samples consumed."""
    generated, trained = lengths.get("generated", {}), lengths.get("trained", {})
    return BiasStats(
        length=LengthBias(
            generated_mean=_mean(
                totals.tokens_generated - totals.tokens_masked, totals.rollouts_received
            ),
            trained_mean=_mean(totals.tokens_consumed, totals.rollouts_acked),
            ks=ks_distance(_counts(generated), _counts(trained)),
            histogram=LengthHistograms(
                generated={int(EDGES[b]): n for b, n in sorted(generated.items()) if n},
                trained={int(EDGES[b]): n for b, n in sorted(trained.items()) if n},
            ),
        ),
        reward=RewardBias(
            generated_mean=_mean(totals.reward_generated_sum, totals.reward_generated_n),
            trained_mean=_mean(totals.reward_trained_sum, totals.reward_trained_n),
        ),
    )
