"""The importance-weight correction of ``measure``, exactly as the SPEC defines it ("Correction
before the update").

With ``old`` the behaviour logprobs (from ingest) and ``new`` the trainer's logprobs on the same
tokens from its forward pass before the update, ``log r_t = new_t - old_t`` over the tokens a
lease hands out as trained (mask-0 tokens weigh 0 and count nowhere). The ``level`` picks the
ratio ``x`` a weight comes from (one per token, or one per rollout given to each of its trained
tokens), the ``mode`` what becomes of it (app/broker/config.py ``Correction``).

Everything is computed in float64 over one concatenated array for the whole batch, per-rollout
sums taken by segment, as app/broker/stats.py does for the ack's figures; weights leave as
float32, the form the trainer receives them in. A ratio is exponentiated only once its log is
capped, so nothing overflows: a weight saturates at :data:`WEIGHT_CAP`, the largest float32, far
above every ``high`` a correction takes (``MAX_CORRECTION_BOUND``), so a saturated ratio is
truncated or masked exactly as its true value would be. ``chi2`` normalises the batch's sequence
ratios in log space, so it stays finite however far apart they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from app.broker.config import Correction
from app.broker.stats import Measured, segment_sums

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

# The largest weight: the largest float32, so weights travel as float32 bytes without inf.
WEIGHT_CAP = float(np.finfo(np.float32).max)
# A log ratio is capped here before exp: exp(89) ≈ 4.5e38 is finite in float64 and above the cap.
_LOG_SATURATE = 89.0
# The largest weight that is 0 in float32 (round to nearest even: 2**-150 is a tie, to 0).
_F32_ZERO = 2.0**-150
# Above this log ratio a ratio is not 0 in float32: exp(-103) ≈ 1.9e-45 > 2**-150 ≈ 7.0e-46.
_NO_UNDERFLOW = -103.0


@dataclass(frozen=True, slots=True)
class Corrected:
    """A batch's correction, rollouts in the order given."""

    weights: list[F32]  # per rollout, aligned with its response tokens (views of one array)
    sequence_weights: F32  # one per rollout; 0 for a rollout with no trained token
    zero_weight: I64  # per rollout: its trained tokens weighing 0
    masked_fraction: float | None  # share of trained tokens weighing 0; None: none trained
    chi2: float | None  # χ² estimate over the sequence ratios; None: no rollout trained


@dataclass(frozen=True, slots=True)
class _Batch:
    """The batch's log ratios, concatenated: mask-0 tokens hold 0, so segment sums skip them."""

    log_r: F64
    keep: npt.NDArray[np.bool_] | None  # trained tokens; None: every token is trained
    lengths: I64  # response tokens per rollout
    trained: I64  # trained tokens per rollout
    starts: I64  # each rollout's first token in the concatenation


def _batch(items: Sequence[Measured]) -> _Batch:
    """The log ratios of every rollout, written into one float64 array (from the float32 sides,
    so ``new - old`` is exact), rollout by rollout: one fresh token-sized array rather than the
    three that concatenating each side and subtracting make, whose page faults cost more than
    the arithmetic (stats.py says the same of the ack)."""
    lengths = np.array([0 if it.old is None else it.old.size for it in items], dtype=np.int64)
    starts = np.zeros(len(items), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    total = int(lengths.sum())
    log_r = np.empty(total, dtype=np.float64)
    masked = any(it.mask is not None for it in items)
    keep = np.ones(total, dtype=np.bool_) if masked else None
    trained = lengths.copy()
    for i, (it, s, n) in enumerate(zip(items, starts.tolist(), lengths.tolist(), strict=True)):
        if it.old is None or it.new is None:
            raise ValueError(f"rollout {i} lacks logprobs on one side; it cannot be corrected")
        if it.new.size != n or (it.mask is not None and it.mask.size != n):
            raise ValueError(f"rollout {i}: logprobs and mask differ in length")
        part = log_r[s : s + n]
        np.subtract(it.new, it.old, out=part, dtype=np.float64)
        if it.mask is not None and keep is not None:
            kept = it.mask.view(np.bool_)
            keep[s : s + n] = kept
            np.multiply(part, kept, out=part)  # finite × 0 = 0: mask-0 tokens add nothing
            trained[i] = np.count_nonzero(kept)
    return _Batch(log_r, keep, lengths, trained, starts)


def _ratio(log_x: F64) -> F64:
    """``exp(log_x)`` saturating at :data:`WEIGHT_CAP`, in place: the log is capped first, so
    exp never overflows (and underflow to 0 is exact enough: no weight is that small in
    float32)."""
    np.minimum(log_x, _LOG_SATURATE, out=log_x)
    np.exp(log_x, out=log_x)
    return np.minimum(log_x, WEIGHT_CAP, out=log_x)


def _apply(x: F64, c: Correction) -> F64:
    """The mode's weight of each ratio, in place: TIS truncates at ``high``, MIS (icepop) keeps
    a ratio only within ``[low, high]``, ``none`` leaves it."""
    if c.mode == "truncate":
        return np.minimum(x, c.high, out=x)
    if c.mode == "mask":
        np.copyto(x, 0.0, where=(x < c.low) | (x > c.high))
    return x


def _level_log(seq_log: F64, trained: I64, level: str) -> F64:
    """A copy of the rollouts' log ratios at ``level``: the sum over trained tokens
    (``sequence``) or their mean (``geometric``); 0 for a rollout with no trained token, whose
    weights are all 0 anyway."""
    out = seq_log.copy()
    if level == "geometric":
        np.divide(out, trained, out=out, where=trained > 0)
    return out


def chi2(seq_log: F64) -> float | None:
    """``mean(ρ²) − 1`` over sequence ratios ``ρ = exp(seq_log)`` normalised to mean 1, taken
    as ``mean((ρ − 1)²)`` (the same value once mean ρ = 1, without the cancellation near 0).
    Ratios are shifted by their largest log before exp: at most 1 each, so no overflow, and the
    shift cancels in the normalisation."""
    n = seq_log.size
    if not n:
        return None
    shifted = np.exp(seq_log - seq_log.max())
    rho = shifted * (n / shifted.sum())
    rho -= 1.0
    return float(np.dot(rho, rho) / n)


def zero_weights(log_r: F64, starts: I64, lengths: I64, correction: Correction) -> I64:
    """Per rollout, the trained tokens :func:`correct` weighs 0, from the log ratios of the
    trained tokens only, concatenated (``starts`` and ``lengths`` their segments): what the
    ack's per-generator sums need, without the weights. At token level under ``truncate`` or
    ``none`` only a ratio that underflows float32 weighs 0, which one reduction rules out for
    a batch near on-policy; otherwise the weights are computed as :func:`correct` does and
    compared in float64 with the largest value float32 rounds to 0."""
    if correction.level == "token":
        if correction.mode != "mask" and (not log_r.size or float(log_r.min()) > _NO_UNDERFLOW):
            return np.zeros(lengths.size, dtype=np.int64)
        w = _apply(_ratio(log_r.copy()), correction)
        zero: I64 = segment_sums(w <= _F32_ZERO, starts, lengths)
        return zero
    seq_log = segment_sums(log_r, starts, lengths)
    seq_w = _apply(_ratio(_level_log(seq_log, lengths, correction.level)), correction)
    return np.where(seq_w <= _F32_ZERO, lengths, 0)


def correct(items: Sequence[Measured], correction: Correction) -> Corrected:
    """The weights, sequence weights, ``masked_fraction`` and ``chi2`` of one batch. Every
    rollout needs logprobs on both sides (``old`` and ``new``) of equal length, and its mask,
    if any, as :func:`app.broker.tokens.hand_out` gave it for the lease.

    ``sequence_weights`` is the rollout's one weight at ``sequence`` and ``geometric`` level;
    at ``token`` level, where weights differ token by token, it is the mean of the weights of
    its trained tokens (docs/design.md)."""
    b = _batch(items)
    seq_log = segment_sums(b.log_r, b.starts, b.lengths)
    if correction.level == "token":
        w = _apply(_ratio(b.log_r), correction)  # log_r is not needed again: in place
        if b.keep is not None:
            np.multiply(w, b.keep, out=w)
        seq_w = segment_sums(w, b.starts, b.lengths)
        np.divide(seq_w, b.trained, out=seq_w, where=b.trained > 0)
        weights = w.astype(np.float32)
    else:
        seq_w = _apply(_ratio(_level_log(seq_log, b.trained, correction.level)), correction)
        seq_w[b.trained == 0] = 0.0
        # Spread as float32 at once: half the bytes of a float64 spread, and no second copy.
        weights = np.repeat(seq_w.astype(np.float32), b.lengths)
        if b.keep is not None:
            np.multiply(weights, b.keep, out=weights)
    total = int(b.trained.sum())
    # Counted on the float32 weights the trainer receives: mask-0 tokens are the other zeros.
    if correction.level == "token":
        zero = segment_sums(weights == 0, b.starts, b.lengths) - (b.lengths - b.trained)
    else:
        zero = np.where(seq_w.astype(np.float32) == 0, b.trained, 0)
    return Corrected(
        weights=[
            weights[s : s + n] for s, n in zip(b.starts.tolist(), b.lengths.tolist(), strict=True)
        ],
        sequence_weights=seq_w.astype(np.float32),
        zero_weight=zero,
        masked_fraction=int(zero.sum()) / total if total else None,
        chi2=chi2(seq_log[b.trained > 0]),
    )
