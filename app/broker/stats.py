"""Off-policy statistics of an acknowledged batch, exactly as the SPEC defines them.

With ``old`` the behaviour logprobs (from ingest) and ``new`` the current policy's (from the
ack), per token ``log_r = new - old`` and ``r = exp(log_r)``; Schulman's estimators of
KL(π_old ‖ π_new) from samples of π_old are ``k1 = -log_r``, ``k2 = log_r² / 2`` and
``k3 = (r - 1) - log_r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


def kl_per_token(
    log_r: F64, estimator: str, r_minus_1: F64 | None = None, out: F64 | None = None
) -> F64:
    """Per-token KL estimates. ``r_minus_1`` is ``expm1(log_r)`` when the caller has it;
    ``out`` (which may be ``r_minus_1``) receives the result."""
    if estimator == "k1":
        return np.negative(log_r, out=out)
    if estimator == "k2":
        k = np.multiply(log_r, log_r, out=out)
        k *= 0.5
        return k
    if estimator == "k3":
        em1 = np.expm1(log_r) if r_minus_1 is None else r_minus_1
        return np.subtract(em1, log_r, out=out)
    raise ValueError(f"unknown KL estimator {estimator!r}")


@dataclass(frozen=True, slots=True)
class Measured:
    """One rollout of a batch as the ack sees it."""

    old: npt.NDArray[np.float32] | None  # behaviour logprobs, None if ingested without
    new: npt.NDArray[np.floating[Any]] | None  # current logprobs from the ack, None if not given
    kl: float | None  # ready-made KL from the ack
    tokens: int


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


def ess_fraction(seq_log_w: F64) -> float:
    """(Σw)² / (n·Σw²) with w = exp(seq_log_w), computed without overflow."""
    n = seq_log_w.size
    shifted = np.exp(seq_log_w - seq_log_w.max())
    return float(shifted.sum() ** 2 / (n * np.square(shifted).sum()))


def batch_figures(items: Sequence[Measured], estimator: str, clip_epsilon: float) -> BatchFigures:
    """The figures of one batch. Rollouts with logprobs on both sides are measured together:
    their tokens are concatenated once and per-rollout sums taken by segment, so the cost is a
    handful of numpy calls per batch rather than per rollout."""
    per: list[float | None] = [None] * len(items)
    pairs = [
        (i, it.old, it.new)
        for i, it in enumerate(items)
        if it.old is not None and it.new is not None
    ]
    kl_sum, kl_tokens = 0.0, 0
    ratio_sum, clipped, ratio_tokens, ess = 0.0, 0, 0, None
    if pairs:
        # Two token-sized buffers, reused in place: a batch holds ~10^5-10^6 tokens, and fresh
        # arrays of that size cost more in page faults than the arithmetic itself.
        buf = np.concatenate([o for _, o, _ in pairs], dtype=np.float64)
        log_r = np.concatenate([n for _, _, n in pairs], dtype=np.float64)
        log_r -= buf
        lengths = np.fromiter((o.size for _, o, _ in pairs), dtype=np.int64, count=len(pairs))
        starts = np.zeros(len(pairs), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        ess = ess_fraction(np.add.reduceat(log_r, starts))
        # r - 1 rather than r: exact near 1, where on-policy tokens are, and it serves k3,
        # the ratio sum (n + Σ(r - 1)) and the clip test alike.
        r_minus_1 = np.expm1(log_r, out=buf)
        ratio_tokens = kl_tokens = int(log_r.size)
        ratio_sum = ratio_tokens + float(r_minus_1.sum())
        clipped = int(
            np.count_nonzero(r_minus_1 > clip_epsilon) + np.count_nonzero(r_minus_1 < -clip_epsilon)
        )
        k = kl_per_token(log_r, estimator, r_minus_1, out=buf)
        k_seq = np.add.reduceat(k, starts)
        for (i, _, _), mean in zip(pairs, (k_seq / lengths).tolist(), strict=True):
            per[i] = mean
        kl_sum = float(k_seq.sum())
    for i, it in enumerate(items):
        if per[i] is None and it.kl is not None:
            per[i] = it.kl
            kl_sum += it.kl * it.tokens
            kl_tokens += it.tokens
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
    )
