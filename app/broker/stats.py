"""Off-policy statistics of an acknowledged batch, exactly as the SPEC defines them.

With ``old`` the behaviour logprobs (from ingest) and ``new`` the current policy's (from the
ack), per token ``log_r = new - old`` and ``r = exp(log_r)``; Schulman's estimators of
KL(π_old ‖ π_new) from samples of π_old are ``k1 = -log_r``, ``k2 = log_r² / 2`` and
``k3 = (r - 1) - log_r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


def kl_per_token(log_r: F64, estimator: str) -> F64:
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if estimator == "k3":
        return np.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}")


@dataclass(frozen=True, slots=True)
class Measured:
    """One rollout of a batch as the ack sees it."""

    old: npt.NDArray[np.float32] | None  # behaviour logprobs, None if ingested without
    new: npt.NDArray[np.float32] | None  # current logprobs from the ack, None if not given
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
    per: list[float | None] = []
    log_rs: list[F64] = []
    kl_sum, kl_tokens = 0.0, 0
    for it in items:
        if it.old is not None and it.new is not None:
            log_r = it.new.astype(np.float64) - it.old.astype(np.float64)
            k = kl_per_token(log_r, estimator)
            per.append(float(k.mean()))
            log_rs.append(log_r)
            kl_sum += float(k.sum())
            kl_tokens += log_r.size
        elif it.kl is not None:
            per.append(it.kl)
            kl_sum += it.kl * it.tokens
            kl_tokens += it.tokens
        else:
            per.append(None)
    measured = [x for x in per if x is not None]
    if log_rs:
        all_log_r = np.concatenate(log_rs)
        r = np.exp(all_log_r)
        ratio_sum = float(r.sum())
        clipped = int(np.count_nonzero(np.abs(r - 1.0) > clip_epsilon))
        ratio_tokens = int(r.size)
        seq = np.fromiter((lr.sum() for lr in log_rs), dtype=np.float64, count=len(log_rs))
        ess: float | None = ess_fraction(seq)
    else:
        ratio_sum, clipped, ratio_tokens, ess = 0.0, 0, 0, None
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
