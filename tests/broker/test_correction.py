"""The correction of ``measure`` against a plain float64 recompute, one rollout at a time.

The recompute below is written from the SPEC's sentences, not from app/broker/correction.py: a
Python loop over rollouts, boolean indexing for the trained tokens, ``np.sum`` (pairwise, where
the module reduces by segment), naive ``exp`` (overflow to inf allowed, then saturated at the
largest float32 as documented), and ``chi2`` through ``np.logaddexp.reduce``.

Tolerances: both sides see the same float32 inputs and exact float64 differences, and differ
only in summation order, which moves a log sum of n terms of size |L| by about n·|L|·1e-16
(≤ 1e-10 here, with |L| ≤ 700 and n ≤ 24): after exp a relative 1e-10, far below a float32 ulp
(1.2e-7). So weights agree to 2 float32 ulps, plus one float32 subnormal step (1.4e-45) for
ratios that underflow into the subnormals. ``masked_fraction`` is a count: exact. ``chi2`` is
compared at rel 1e-8 (log sums moved by ~1e-10 move each ρ by as much) and abs 1e-12 (the
recompute's ``mean(ρ²) − 1`` loses ~n·1e-16 to cancellation near 0).
"""

import math
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from app.broker.config import Correction, RunConfig
from app.broker.correction import WEIGHT_CAP, correct, zero_weights
from app.broker.stats import Measured, batch_figures

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "none")
PAIRS = [(lv, md) for lv in LEVELS for md in MODES]


def item(old, new, mask=None):
    old = np.asarray(old, dtype=np.float32)
    mask = None if mask is None else np.asarray(mask, dtype=np.uint8)
    trained = old.size if mask is None else int(mask.sum())
    return Measured(old, np.asarray(new, dtype=np.float32), None, trained, mask)


def expected(items, c):
    """Weights, sequence weights, masked_fraction and chi2, rollout by rollout in float64."""

    def rule(x):
        x = min(x, WEIGHT_CAP)
        if c.mode == "truncate":
            return min(x, c.high)
        if c.mode == "mask":
            return x if c.low <= x <= c.high else 0.0
        return x

    weights, seq_w, seq_logs, zeros, trained_total = [], [], [], 0, 0
    with np.errstate(over="ignore"):
        for it in items:
            keep = np.ones(it.old.size, bool) if it.mask is None else it.mask.astype(bool)
            log_r = it.new.astype(np.float64)[keep] - it.old.astype(np.float64)[keep]
            w = np.zeros(it.old.size)
            if c.level == "token":
                w[keep] = [rule(float(np.exp(v))) for v in log_r]
                s = float(w[keep].mean()) if keep.any() else 0.0
            elif keep.any():
                log_x = log_r.sum() if c.level == "sequence" else log_r.mean()
                s = rule(float(np.exp(log_x)))
                w[keep] = s
            else:
                s = 0.0
            w32 = w.astype(np.float32)
            zeros += int((w32[keep] == 0).sum())
            trained_total += int(keep.sum())
            weights.append(w32)
            seq_w.append(s)
            if keep.any():
                seq_logs.append(float(log_r.sum()))
    chi2 = None
    if seq_logs:
        logs = np.array(seq_logs)
        log_rho = logs + math.log(logs.size) - np.logaddexp.reduce(logs)
        chi2 = float(np.mean(np.exp(2 * log_rho)) - 1)
    fraction = zeros / trained_total if trained_total else None
    return weights, np.array(seq_w, dtype=np.float32), fraction, chi2


def check(items, c):
    got = correct(items, c)
    weights, seq_w, fraction, chi2 = expected(items, c)
    assert len(got.weights) == len(weights)
    for g, e in zip(got.weights, weights, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, e, rtol=2.4e-7, atol=1.5e-45)
    assert got.sequence_weights.dtype == np.float32
    np.testing.assert_allclose(got.sequence_weights, seq_w, rtol=2.4e-7, atol=1.5e-45)
    assert got.masked_fraction == fraction
    if chi2 is None:
        assert got.chi2 is None
    else:
        assert got.chi2 == pytest.approx(chi2, rel=1e-8, abs=1e-12)
    return got


# A log ratio per token: mostly near on-policy, sometimes extreme (exp(±80) is past float32,
# exp(±700) near float64's own limit, and a sum of a few of those past it).
DELTA = st.one_of(
    st.floats(-3, 3),
    st.floats(-3, 3),
    st.sampled_from([-700.0, -80.0, 80.0, 700.0]),
)


@st.composite
def rollouts(draw):
    n = draw(st.integers(0, 24))
    old = [draw(st.floats(-800, 0, width=32)) for _ in range(n)]
    new = [min(0.0, o + draw(DELTA)) for o in old]
    mask = draw(st.none() | st.lists(st.integers(0, 1), min_size=n, max_size=n))
    return item(old, new, mask)


BOUNDS = st.tuples(
    st.sampled_from([0.0, 0.5, 0.8, 1.0]) | st.floats(0, 5),
    st.sampled_from([1.0, 1.2, 2.0, 5.0]) | st.floats(1e-3, 1e3),
).filter(lambda lh: lh[0] <= lh[1])


@pytest.mark.parametrize(("level", "mode"), PAIRS)
@settings(max_examples=40, deadline=None)
@given(batch=st.lists(rollouts(), min_size=1, max_size=8), bounds=BOUNDS)
def test_matches_the_float64_recompute(level, mode, batch, bounds):
    check(batch, Correction(level=level, mode=mode, low=bounds[0], high=bounds[1]))


@pytest.mark.parametrize(("level", "mode"), PAIRS)
def test_extreme_ratios_neither_overflow_nor_warn(level, mode):
    """Sequence sums of ±700-per-token ratios are far past float64's exp; nothing overflows
    (numpy is told to raise on it) and a huge ratio saturates at the largest float32."""
    old = np.full(16, -750.0)
    batch = [item(old, old + 700), item(old, old + 700), item(old + 700, old), item(old, old)]
    c = Correction(level=level, mode=mode, low=0.5, high=2.0)
    with np.errstate(over="raise", invalid="raise"):
        got = check(batch, c)
    assert np.isfinite(got.sequence_weights).all()
    assert math.isfinite(got.chi2)
    if mode == "none":
        assert got.weights[0].max() == np.float32(WEIGHT_CAP)


def test_chi2_of_extreme_sequence_ratios_is_n_minus_1():
    """One rollout whose ratio dwarfs the others: ρ normalised is n for it and 0 for the rest."""
    old = np.full(4, -750.0)
    batch = [item(old, old + 700)] + [item(old, old)] * 3
    assert correct(batch, Correction()).chi2 == pytest.approx(3.0, rel=1e-12)


def test_chi2_is_zero_when_every_sequence_ratio_is_equal():
    batch = [item([-1.0, -2.0], [-0.5, -2.5]), item([-3.0], [-3.0]), item([-0.25], [-0.25])]
    assert correct(batch, Correction()).chi2 == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("level", LEVELS)
def test_one_trained_token_weighs_its_own_ratio_at_every_level(level):
    """With a single trained token the sequence sum, the mean and the token ratio coincide."""
    batch = [item([-1.0, -2.0, -3.0], [-1.5, -1.75, -9.0], [0, 1, 0])]
    got = correct(batch, Correction(level=level, mode="none"))
    r = math.exp(0.25)
    np.testing.assert_allclose(got.weights[0], [0.0, r, 0.0], rtol=1e-7)
    assert got.sequence_weights[0] == pytest.approx(r, rel=1e-7)
    assert got.masked_fraction == 0.0


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_a_rollout_masked_by_the_mode_weighs_0_everywhere(level):
    """The whole rollout out of bounds: every trained token weighs 0 and counts as masked."""
    batch = [item([-1.0, -1.0, -1.0], [-0.1, -0.1, -0.1], [1, 1, 0]), item([-1.0], [-1.0])]
    got = correct(batch, Correction(level=level, mode="mask", low=0.5, high=2.0))
    assert got.weights[0].tolist() == [0.0, 0.0, 0.0]
    assert got.sequence_weights.tolist() == [0.0, 1.0]
    assert got.masked_fraction == pytest.approx(2 / 3)


def test_a_rollout_with_no_trained_token_weighs_0_and_leaves_chi2_alone():
    batch = [item([-1.0, -2.0], [-0.1, -5.0], [0, 0]), item([-1.0], [-0.5]), item([-1.0], [-0.5])]
    for level in LEVELS:
        got = correct(batch, Correction(level=level, mode="none"))
        assert got.weights[0].tolist() == [0.0, 0.0]
        assert got.sequence_weights[0] == 0.0
        assert got.masked_fraction == 0.0
        assert got.chi2 == pytest.approx(0.0, abs=1e-15)


def test_below_low_is_masked_but_not_truncated():
    """``low`` bounds ``mask`` only: truncation is one-sided (TIS: min(x, high))."""
    batch = [item([-1.0, -1.0], [-2.0, -1.0])]  # ratios e^-1 and 1
    masked = correct(batch, Correction(mode="mask", low=0.5, high=2.0))
    truncated = correct(batch, Correction(mode="truncate", low=0.5, high=2.0))
    np.testing.assert_allclose(masked.weights[0], [0.0, 1.0])
    np.testing.assert_allclose(truncated.weights[0], [math.exp(-1), 1.0], rtol=1e-7)
    assert masked.masked_fraction == 0.5
    assert truncated.masked_fraction == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_a_ratio_exactly_at_either_bound_is_kept(mode):
    """Bounds are inclusive: x = low and x = high keep their weight x."""
    x = float(np.exp(np.float64(np.float32(-0.5)) - np.float64(np.float32(-1.0))))
    batch = [item([-1.0], [-0.5])]
    for low, high in [(x, 10.0), (0.0, x), (x, x)]:
        got = correct(batch, Correction(mode=mode, low=low, high=high))
        assert got.weights[0].tolist() == [np.float32(x)]
        assert got.masked_fraction == 0.0


def test_truncation_caps_at_high():
    batch = [item([-5.0, -1.0], [-1.0, -1.0])]  # ratios e^4 and 1
    got = correct(batch, Correction(mode="truncate", high=2.0))
    assert got.weights[0].tolist() == [2.0, 1.0]
    assert got.sequence_weights[0] == 1.5  # token level: the mean of trained-token weights


def test_empty_rollouts_keep_their_place():
    """A response of no tokens sits between others: the segment sums must not shift."""
    batch = [item([], []), item([-1.0, -1.0], [-0.5, -1.5]), item([], []), item([-2.0], [-1.0])]
    for level in LEVELS:
        got = check(batch, Correction(level=level, mode="none"))
        assert [w.size for w in got.weights] == [0, 2, 0, 1]


def test_needs_logprobs_on_both_sides_of_equal_length():
    with pytest.raises(ValueError, match="lacks logprobs"):
        correct([Measured(np.float32([-1.0]), None, None, 1)], Correction())
    with pytest.raises(ValueError, match="differ in length"):
        correct([item([-1.0, -1.0], [-1.0])], Correction())


def test_the_config_model_has_the_spec_default_and_refuses_bad_bounds():
    spec = {"level": "token", "mode": "truncate", "low": 0, "high": 2}
    assert Correction() == Correction.model_validate(spec)
    assert Correction().model_dump() == {**spec, "low": 0.0, "high": 2.0}
    for bad in [
        {"low": 3, "high": 2},
        {"high": 0},
        {"low": -1},
        {"high": float("inf")},
        {"level": "batch"},
        {"mode": "clip"},
        {"other": 1},
    ]:
        with pytest.raises(ValidationError):
            Correction.model_validate(bad)
    assert RunConfig().correction == Correction()  # the SPEC's default


@pytest.mark.parametrize(("level", "mode"), PAIRS)
@settings(max_examples=40, deadline=None)
@given(batch=st.lists(rollouts(), min_size=1, max_size=8), bounds=BOUNDS)
def test_the_acks_zero_weights_are_the_corrections(level, mode, batch, bounds):
    """The ack counts each rollout's trained tokens weighing 0 (its per-generator sums) through
    ``batch_figures``, from the log ratios it has, without the weights: the same counts as
    :func:`correct`'s, underflowing and saturating ratios included."""
    c = Correction(level=level, mode=mode, low=bounds[0], high=bounds[1])
    with np.errstate(invalid="ignore", divide="ignore"):  # the KL of a rollout of 0 tokens
        fig = batch_figures(batch, "k3", 0.2, per_rollout=partial(zero_weights, correction=c))
    assert fig.per is not None
    assert fig.per.zero_weight.tolist() == correct(batch, c).zero_weight.tolist()
