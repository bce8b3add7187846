"""Off-policy statistics of an acknowledged batch, exactly as the SPEC defines them.

With ``old`` the behaviour logprobs (from ingest) and ``new`` the current policy's (from the
ack), per token ``log_r = new - old`` and ``r = exp(log_r)``; Schulman's estimators of
KL(π_old ‖ π_new) from samples of π_old are ``k1 = -log_r``, ``k2 = log_r² / 2`` and
``k3 = (r - 1) - log_r``.

Every figure is finite, whatever logprobs were accepted (finite float32, ≤ 0, so
``|log_r| ≤ 3.4e38``): each per-token importance ratio and KL estimate saturates at
:data:`FIGURE_CAP`, and ``exp`` never overflows on the way there (``r`` and ``k3`` are taken
from ``log_r`` compared in log space first). The cap sits above ``|log_r|``'s own bound, so k1 is
never capped, and far above every ``kl_max``/``kl_flush`` a run accepts (≤ 1e12) times the most
tokens a rollout or batch can hold: a capped rollout or batch is gated exactly as its true
figures would be. It also bounds a ready-made ``kl`` (schemas.AckBody). Sums over a batch
(``≤ 1.7e13`` tokens) and over a run's ledger then stay far from double overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

# The largest per-token importance ratio or KL estimate, and the largest ready-made KL.
FIGURE_CAP = 1e40


def _log_cap() -> float:
    x = math.log(FIGURE_CAP)
    while math.expm1(x) > FIGURE_CAP:  # log() may round up by an ulp or two
        x = math.nextafter(x, 0.0)
    return x


# The largest log_r whose r - 1 is computed; above it r - 1 saturates at expm1(LOG_FIGURE_CAP).
LOG_FIGURE_CAP = _log_cap()


def _saturates(log_r: F64) -> bool:
    """Whether any token's r - 1 would pass the cap (one reduction; on-policy data never does)."""
    return bool(log_r.size) and float(log_r.max()) > LOG_FIGURE_CAP


def ratio_minus_1(log_r: F64, out: F64 | None = None, *, saturates: bool | None = None) -> F64:
    """``r - 1 = expm1(log_r)`` per token, at most :data:`FIGURE_CAP`: ``log_r`` is capped
    before it is exponentiated, so nothing overflows. ``saturates`` is :func:`_saturates` of
    ``log_r`` when the caller has it."""
    if not (_saturates(log_r) if saturates is None else saturates):
        return np.expm1(log_r, out=out)
    capped = np.minimum(log_r, LOG_FIGURE_CAP, out=out)
    return np.expm1(capped, out=capped)


def kl_per_token(
    log_r: F64,
    estimator: str,
    r_minus_1: F64 | None = None,
    out: F64 | None = None,
    *,
    saturates: bool | None = None,
) -> F64:
    """Per-token KL estimates, each at most :data:`FIGURE_CAP`. ``r_minus_1`` is
    :func:`ratio_minus_1` of ``log_r`` when the caller has it; ``out`` (which may be
    ``r_minus_1``) receives the result; ``saturates`` is :func:`_saturates` of ``log_r`` when
    the caller has it."""
    if estimator == "k1":
        return np.negative(log_r, out=out)  # |log_r| ≤ 3.4e38 < FIGURE_CAP: never capped
    if estimator == "k2":
        k = np.multiply(log_r, log_r, out=out)  # ≤ 1.2e77: no overflow
        k *= 0.5
        return np.minimum(k, FIGURE_CAP, out=k)
    if estimator == "k3":
        if saturates is None:
            saturates = _saturates(log_r)
        em1 = ratio_minus_1(log_r, saturates=saturates) if r_minus_1 is None else r_minus_1
        k = np.subtract(em1, log_r, out=out)  # for log_r < 0: ≤ -log_r ≤ 3.4e38
        if saturates:
            # Where r - 1 saturated the difference is no longer k3, which is above the cap.
            np.copyto(k, FIGURE_CAP, where=log_r > LOG_FIGURE_CAP)
        return k
    raise ValueError(f"unknown KL estimator {estimator!r}")


class Measured(NamedTuple):
    """One rollout of a batch as the ack sees it (a named tuple: one is built per rollout of
    every ack)."""

    old: npt.NDArray[np.float32] | None  # behaviour logprobs, None if ingested without
    new: npt.NDArray[np.floating[Any]] | None  # current logprobs from the ack, None if not given
    kl: float | None  # ready-made KL from the ack
    tokens: int  # trained tokens
    mask: npt.NDArray[np.uint8] | None = None  # 0 for tokens not trained; None: all trained


@dataclass(frozen=True, slots=True)
class PerRollout:
    """The sums of :class:`BatchFigures` rollout by rollout (0 for one not measured), for the
    per-generator sums of the ``acked`` event."""

    kl_tokens: I64
    kl_sum: F64
    ratio_tokens: I64
    ratio_sum: F64
    clipped: I64
    zero_weight: I64  # trained tokens the correction weighs 0 (from ``zero_weights``)


# Per rollout, the trained tokens weighing 0, from the log ratios of the trained tokens, their
# segments' starts and lengths (app/broker/correction.py zero_weights, the run's correction).
ZeroWeights = Callable[[F64, I64, I64], I64]


@dataclass(frozen=True, slots=True)
class BatchFigures:
    kl: list[float | None]  # per rollout, None = not measured
    kl_mean: float | None
    kl_max: float | None
    is_ratio_mean: float | None
    clip_fraction: float | None
    ess_fraction: float | None
    # exact sums for accounting totals
    kl_tokens: int
    kl_sum: float
    ratio_tokens: int
    ratio_sum: float
    clipped: int
    per: PerRollout | None = None  # asked for with per_rollout=True


def segment_sums(values: npt.NDArray[Any], starts: I64, lengths: I64) -> npt.NDArray[Any]:
    """Per-rollout sums of a concatenated array. ``np.add.reduceat`` gives an empty segment
    the next element instead of 0 (and fails on one at the very end), so only non-empty
    segments are reduced: each then runs exactly to the next non-empty one's start. Counts of
    a boolean array come as int64."""
    sums = np.zeros(lengths.size, dtype=values.dtype if values.dtype != np.bool_ else np.int64)
    full = lengths > 0
    if values.size:
        sums[full] = np.add.reduceat(values, starts[full], dtype=sums.dtype)
    return sums


def ess_fraction(seq_log_w: F64) -> float:
    """(Σw)² / (n·Σw²) with w = exp(seq_log_w), computed without overflow."""
    n = seq_log_w.size
    shifted = np.exp(seq_log_w - seq_log_w.max())
    return float(shifted.sum() ** 2 / (n * np.square(shifted).sum()))


def _trained(
    i: int, old: npt.NDArray[np.float32], new: npt.NDArray[np.floating[Any]], mask: Any
) -> tuple[int, npt.NDArray[np.float32], npt.NDArray[np.floating[Any]]]:
    """A rollout's logprobs on both sides over its trained tokens only."""
    keep = mask.view(np.bool_)
    return i, old[keep], new[keep]


def batch_figures(
    items: Sequence[Measured],
    estimator: str,
    clip_epsilon: float,
    *,
    per_rollout: ZeroWeights | None = None,
) -> BatchFigures:
    """The figures of one batch. Rollouts with logprobs on both sides are measured together:
    their tokens are concatenated once and per-rollout sums taken by segment, so the cost is a
    handful of numpy calls per batch rather than per rollout. With ``per_rollout`` the sums
    are also given rollout by rollout (two more passes over the tokens), with the trained
    tokens weighing 0 that it counts."""
    per: list[float | None] = [None] * len(items)
    pairs = [
        (i, it.old, it.new) if it.mask is None else _trained(i, it.old, it.new, it.mask)
        for i, it in enumerate(items)
        if it.old is not None and it.new is not None
    ]
    each = _PerBuild(len(items)) if per_rollout is not None else None
    kl_sum, kl_tokens = 0.0, 0
    ratio_sum, clipped, ratio_tokens, ess = 0.0, 0, 0, None
    if pairs:
        # Two token-sized buffers, reused in place: a batch holds ~10^5-10^6 tokens, and fresh
        # arrays of that size cost more in page faults than the arithmetic itself.
        buf = np.concatenate([o for _, o, _ in pairs], dtype=np.float64)
        log_r = np.concatenate([n for _, _, n in pairs], dtype=np.float64)
        log_r -= buf
        lengths = np.array([o.size for _, o, _ in pairs], dtype=np.int64)
        starts = np.zeros(len(pairs), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        ess = ess_fraction(segment_sums(log_r, starts, lengths))
        saturates = _saturates(log_r)
        # r - 1 rather than r: exact near 1, where on-policy tokens are, and it serves k3,
        # the ratio sum (n + Σ(r - 1)) and the clip test alike.
        r_minus_1 = ratio_minus_1(log_r, out=buf, saturates=saturates)
        ratio_tokens = kl_tokens = int(log_r.size)
        ratio_sum = ratio_tokens + float(r_minus_1.sum())
        out = (r_minus_1 > clip_epsilon) | (r_minus_1 < -clip_epsilon)
        clipped = int(np.count_nonzero(out))
        if each is not None:
            each.pairs(pairs, lengths, segment_sums(r_minus_1, starts, lengths))
            each.clipped[each.index] = segment_sums(out, starts, lengths)
        k = kl_per_token(log_r, estimator, r_minus_1, out=buf, saturates=saturates)
        k_seq = segment_sums(k, starts, lengths)
        for (i, _, _), mean in zip(pairs, (k_seq / lengths).tolist(), strict=True):
            per[i] = mean
        kl_sum = float(k_seq.sum())
        if each is not None and per_rollout is not None:
            each.kl_sum[each.index] = k_seq
            each.zero_weight[each.index] = per_rollout(log_r, starts, lengths)
    for i, it in enumerate(items):
        if per[i] is None and it.kl is not None:
            per[i] = it.kl
            kl_sum += it.kl * it.tokens
            kl_tokens += it.tokens
            if each is not None:
                each.kl_sum[i], each.kl_tokens[i] = it.kl * it.tokens, it.tokens
    measured = [x for x in per if x is not None]
    return BatchFigures(
        kl=per,
        kl_mean=kl_sum / kl_tokens if kl_tokens else None,
        kl_max=max(measured) if measured else None,
        is_ratio_mean=ratio_sum / ratio_tokens if ratio_tokens else None,
        clip_fraction=clipped / ratio_tokens if ratio_tokens else None,
        ess_fraction=ess,
        kl_tokens=kl_tokens,
        kl_sum=kl_sum,
        ratio_tokens=ratio_tokens,
        ratio_sum=ratio_sum,
        clipped=clipped,
        per=None if each is None else each.done(),
    )


class _PerBuild:
    """:class:`PerRollout` as :func:`batch_figures` fills it in."""

    def __init__(self, n: int) -> None:
        self.index = np.zeros(0, dtype=np.int64)
        self.kl_tokens = np.zeros(n, dtype=np.int64)
        self.kl_sum = np.zeros(n, dtype=np.float64)
        self.ratio_tokens = np.zeros(n, dtype=np.int64)
        self.ratio_sum = np.zeros(n, dtype=np.float64)
        self.clipped = np.zeros(n, dtype=np.int64)
        self.zero_weight = np.zeros(n, dtype=np.int64)

    def pairs(self, pairs: list[Any], lengths: I64, r_minus_1_sums: F64) -> None:
        self.index = np.array([i for i, _, _ in pairs], dtype=np.int64)
        self.kl_tokens[self.index] = lengths
        self.ratio_tokens[self.index] = lengths
        self.ratio_sum[self.index] = lengths + r_minus_1_sums

    def done(self) -> PerRollout:
        return PerRollout(
            self.kl_tokens,
            self.kl_sum,
            self.ratio_tokens,
            self.ratio_sum,
            self.clipped,
            self.zero_weight,
        )
