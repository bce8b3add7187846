"""The off-policy statistics against hand-computed values."""

import math

import numpy as np
import pytest

from app.broker.stats import (
    FIGURE_CAP,
    LOG_FIGURE_CAP,
    Measured,
    batch_figures,
    ess_fraction,
    kl_per_token,
    ratio_minus_1,
)

F32_MIN = float(np.finfo(np.float32).min)


def f32(xs):
    return np.asarray(xs, dtype=np.float32)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", lambda lr: -lr),
        ("k2", lambda lr: lr * lr / 2),
        ("k3", lambda lr: math.exp(lr) - 1 - lr),
    ],
)
def test_estimators_match_their_definitions(estimator, expected):
    log_r = np.array([-0.7, -0.1, 0.0, 0.3, 1.2])
    got = kl_per_token(log_r, estimator)
    assert got == pytest.approx([expected(x) for x in log_r], rel=1e-12, abs=1e-15)


def test_k3_is_non_negative_and_k1_can_be_negative():
    log_r = np.linspace(-3, 3, 61)
    assert (kl_per_token(log_r, "k3") >= 0).all()
    assert (kl_per_token(log_r, "k1") < 0).any()


def test_batch_figures_by_hand():
    old_a, new_a = f32([-1.0, -2.0]), f32([-0.5, -2.0])  # log_r = 0.5, 0
    old_b, new_b = f32([-1.0]), f32([-1.25])  # log_r = -0.25
    fig = batch_figures(
        [Measured(old_a, new_a, None, 2), Measured(old_b, new_b, None, 1)], "k3", 0.2
    )
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    assert fig.kl[0] == pytest.approx((k3(0.5) + k3(0.0)) / 2)
    assert fig.kl[1] == pytest.approx(k3(-0.25))
    assert fig.kl_mean == pytest.approx((k3(0.5) + k3(0) + k3(-0.25)) / 3)
    assert fig.kl_max == pytest.approx(fig.kl[0])
    r = [math.exp(0.5), 1.0, math.exp(-0.25)]
    assert fig.is_ratio_mean == pytest.approx(sum(r) / 3)
    assert fig.clip_fraction == pytest.approx(2 / 3)  # 1.65 and 0.78 are outside [0.8, 1.2]
    w = [math.exp(0.5), math.exp(-0.25)]
    assert fig.ess_fraction == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)))
    assert (fig.kl_tokens, fig.ratio_tokens, fig.clipped) == (3, 3, 2)


def test_ready_made_kl_is_weighted_by_tokens_and_unmeasured_rollouts_are_skipped():
    fig = batch_figures(
        [
            Measured(None, None, 0.3, 10),
            Measured(f32([-1.0]), f32([-1.0]), None, 1),
            Measured(None, None, None, 5),
            Measured(None, f32([-1.0]), None, 1),  # ingested without logprobs
        ],
        "k1",
        0.2,
    )
    assert fig.kl == [0.3, 0.0, None, None]
    assert fig.kl_mean == pytest.approx((0.3 * 10 + 0.0) / 11)
    assert fig.kl_max == pytest.approx(0.3)
    assert fig.is_ratio_mean == pytest.approx(1.0)
    assert fig.ess_fraction == pytest.approx(1.0)


def test_nothing_measured_gives_no_statistics():
    fig = batch_figures([Measured(None, None, None, 3)], "k3", 0.2)
    assert (fig.kl_mean, fig.kl_max, fig.is_ratio_mean, fig.clip_fraction, fig.ess_fraction) == (
        None,
        None,
        None,
        None,
        None,
    )


def test_ess_is_stable_for_huge_sequence_log_weights():
    # exp(800) overflows float64; in log space the answer is still exact.
    assert ess_fraction(np.array([800.0, 800.0])) == pytest.approx(1.0)
    assert ess_fraction(np.array([800.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert ess_fraction(np.array([-5.0, -5.0, -5.0])) == pytest.approx(1.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_batch_figures_agree_with_a_rollout_by_rollout_computation(estimator):
    """The batch is measured in one pass over its concatenated tokens; every figure must equal
    the SPEC's definition applied rollout by rollout, whatever the mix of kinds and lengths."""
    rng = np.random.default_rng(7)
    items, reference = [], []
    for n in range(40):
        tokens = int(rng.integers(1, 300))
        old = f32(-rng.exponential(1.0, tokens))
        new = f32(np.minimum(old + rng.normal(0, 0.3, tokens), 0.0))
        kind = n % 4
        if kind == 0:
            items.append(Measured(old, new, None, tokens))
        elif kind == 1:
            items.append(Measured(None, None, float(rng.random()), tokens))
        elif kind == 2:
            items.append(Measured(old, None, None, tokens))
        else:
            items.append(Measured(None, new, None, tokens))
        reference.append((kind, old.astype(np.float64), new.astype(np.float64), items[-1].kl))
    fig = batch_figures(items, estimator, 0.2)

    kl_sum = kl_tokens = ratio_sum = clipped = ratio_tokens = 0.0
    seq_log_w = []
    for (kind, old, new, ready), got in zip(reference, fig.kl, strict=True):
        if kind == 0:
            log_r = new - old
            k = kl_per_token(log_r, estimator)
            assert got == pytest.approx(k.mean(), rel=1e-9, abs=1e-12)
            kl_sum += k.sum()
            kl_tokens += k.size
            r = np.exp(log_r)
            ratio_sum += r.sum()
            clipped += np.count_nonzero(np.abs(r - 1) > 0.2)
            ratio_tokens += r.size
            seq_log_w.append(log_r.sum())
        elif kind == 1:
            assert got == ready
            kl_sum += ready * old.size
            kl_tokens += old.size
        else:
            assert got is None
    assert fig.kl_mean == pytest.approx(kl_sum / kl_tokens, rel=1e-9)
    assert fig.kl_max == max(x for x in fig.kl if x is not None)
    assert fig.is_ratio_mean == pytest.approx(ratio_sum / ratio_tokens, rel=1e-9)
    assert fig.clip_fraction == pytest.approx(clipped / ratio_tokens)
    assert (fig.kl_tokens, fig.ratio_tokens, fig.clipped) == (kl_tokens, ratio_tokens, clipped)
    w = np.exp(np.array(seq_log_w))
    assert fig.ess_fraction == pytest.approx(w.sum() ** 2 / (w.size * (w * w).sum()), rel=1e-9)


# -- the cap: every figure finite, whatever logprobs an ack may carry -------------------------

FIGURES = ("kl_mean", "kl_max", "is_ratio_mean", "clip_fraction", "ess_fraction")
# log_r = new - old at and around every bound: float32's extremes, exp's overflow (709.8),
# the cap's own threshold (92.1), on-policy and barely off it.
EXTREME_LOG_R = [
    -F32_MIN,
    1000.0,
    710.0,
    LOG_FIGURE_CAP + 0.5,
    LOG_FIGURE_CAP,
    50.0,
    1e-30,
    0.0,
    -1e-30,
    -50.0,
    -1000.0,
    F32_MIN,
]


def test_the_cap_sits_where_the_docs_say():
    assert FIGURE_CAP == 1e40
    assert math.expm1(LOG_FIGURE_CAP) <= FIGURE_CAP < math.expm1(math.nextafter(LOG_FIGURE_CAP, 99))
    # Above float32's largest magnitude, so k1 (= -log_r) is never capped ...
    assert -F32_MIN < FIGURE_CAP
    # ... and above every kl_max / kl_flush (<= 1e12) times the most tokens of a batch
    # (1e6 rollouts x 2**24 tokens), so a capped figure is gated as the true one would be.
    assert FIGURE_CAP / (1_000_000 * 2**24) > 1e12


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_per_token_figures_are_finite_and_capped_at_every_bound(estimator):
    log_r = np.array(EXTREME_LOG_R)
    with np.errstate(all="raise"):  # no overflow on the way either
        k = kl_per_token(log_r, estimator)
        em1 = ratio_minus_1(log_r)
    assert np.isfinite(k).all() and np.isfinite(em1).all()
    assert (k <= FIGURE_CAP).all() and (em1 <= FIGURE_CAP).all()
    assert (em1 >= -1).all()
    if estimator == "k1":
        assert list(k) == [-x for x in EXTREME_LOG_R]  # never capped
    elif estimator == "k2":  # log_r² / 2 reaches the cap only near float32's extremes
        assert k[0] == k[-1] == FIGURE_CAP
        assert k[1] == 500_000.0
    else:  # above the threshold r saturates, and k3 (larger still) is the cap itself
        assert list(k[:4]) == [FIGURE_CAP] * 4
        assert k[-1] == -1 - F32_MIN  # for log_r < 0, k3 = e^log_r - 1 - log_r needs no cap


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_below_the_cap_figures_are_exact(estimator):
    log_r = np.array([-80.0, -20.0, -1.0, 0.0, 1.0, 20.0, 80.0])
    exact = {
        "k1": [-x for x in log_r],
        "k2": [x * x / 2 for x in log_r],
        "k3": [math.expm1(x) - x for x in log_r],
    }[estimator]
    assert kl_per_token(log_r, estimator) == pytest.approx(exact, rel=1e-12)
    assert ratio_minus_1(log_r) == pytest.approx([math.expm1(x) for x in log_r], rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ([-1000.0], [0.0]),  # the reported case: exp(1000) overflowed, the ack lost its event
        ([F32_MIN], [0.0]),
        ([0.0], [F32_MIN]),
        ([F32_MIN] * 4096, [0.0] * 4096),  # sums over many capped tokens
        ([-1000.0, -0.5], [0.0, -0.5]),
    ],
    ids=["minus_1000", "f32_min_to_0", "0_to_f32_min", "many_capped", "mixed"],
)
def test_batch_figures_stay_finite_at_the_extremes(estimator, old, new):
    items = [Measured(f32(old), f32(new), None, len(old)), Measured(None, None, FIGURE_CAP, 8)]
    with np.errstate(all="raise"):
        fig = batch_figures(items, estimator, 0.2)
    values = [getattr(fig, name) for name in FIGURES] + [fig.kl_sum, fig.ratio_sum, *fig.kl]
    assert all(v is not None and math.isfinite(v) for v in values), values
    assert fig.kl_max == FIGURE_CAP  # the ready-made one at the cap
    assert 0 < fig.ess_fraction <= 1


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_a_capped_rollout_is_judged_as_its_true_kl_would_be(estimator):
    """One saturated token among the most a rollout may have still puts the rollout's KL above
    the largest kl_max a run accepts, as its true (overflowing) KL would."""
    tokens = 2**24
    old = np.zeros(tokens, dtype=np.float32)
    new = np.zeros(tokens, dtype=np.float32)
    old[0] = F32_MIN if estimator == "k3" else 0.0
    new[0] = 0.0 if estimator == "k3" else F32_MIN
    fig = batch_figures([Measured(old, new, None, tokens)], estimator, 0.2)
    assert fig.kl[0] is not None and fig.kl[0] > 1e12
    assert fig.kl_mean is not None and fig.kl_mean > 1e12
